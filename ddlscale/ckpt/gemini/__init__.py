"""``ckpt=gemini``: checkpoints every iteration into peers' CPU memory, recovered in seconds.

* :mod:`~ddlscale.ckpt.gemini.gemini_checkpointer` — ``GeminiCheckpointer``: capture, send, commit;
  :mod:`~ddlscale.ckpt.gemini.recovery` — getting the committed version back (peers, else disk).
* :mod:`~ddlscale.ckpt.gemini.placement` — which machines hold whose replicas; recovery probabilities.
* :mod:`~ddlscale.ckpt.gemini.interleave`, :mod:`~ddlscale.ckpt.gemini.idle_gaps` — sending in the gaps
  between training collectives, and watching those collectives.
* :mod:`~ddlscale.ckpt.gemini.protocol`, :mod:`~ddlscale.ckpt.gemini.auth` — the authenticated agent
  protocol and its client; the job's secret and the keys derived from it.
* :mod:`~ddlscale.ckpt.gemini.kvstore` — the job's signed keys in a TCPStore or etcd.
* :mod:`~ddlscale.ckpt.gemini.agent` — the per-machine replica agent (slots, server, membership).
* :mod:`~ddlscale.ckpt.gemini.services`, :mod:`~ddlscale.ckpt.gemini.env` — the launch hooks: checks,
  and the secret, store and agents around the workers; what the workers are told.
* :mod:`~ddlscale.ckpt.gemini.drain`, :mod:`~ddlscale.ckpt.gemini.control` — a launch's last committed
  version to disk when it ends; watching a job.
"""
