"""Drills against a running system, for tests and experiments (each runnable with ``python -m``).

* :mod:`~ddlscale.testing.drill` — failure drills: a Gemini job on the emulated cluster, real kills
  and machine replacements.
* :mod:`~ddlscale.testing.security_drill` — the hostile-client drill: what a stranger on the network
  might try against a Gemini job, each expected to be refused.
"""
