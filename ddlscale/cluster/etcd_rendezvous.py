"""torchrun's rendezvous on every member of an etcd cluster: ``--rdzv-backend=ddlscale-etcd``.

torch offers two etcd rendezvous backends. ``etcd`` is the older, separate implementation;
``etcd-v2`` is torch's dynamic rendezvous (the state machine, keep-alives and dead-node handling of
its default ``c10d`` backend, which torch maintains) keeping its state in etcd. We use the latter
as it is — its backend, its etcd store, its handler — and change one thing: torch builds its etcd
client for the single host of ``--rdzv-endpoint``, so that member would be the job's single point of
failure again. Here the endpoint lists every member (``HOST:PORT,HOST:PORT,...``) and the client
moves to the next when one stops answering. ``--rdzv-conf`` takes torch's own etcd options:
``protocol=https``, ``ca_cert``, ``ssl_cert``, ``ssl_cert_key``, ``read_timeout``.

Registered through torchrun's plug-in entry point (``torchrun.handlers`` in pyproject.toml), so
``torchrun --rdzv-backend=ddlscale-etcd`` works wherever ddlscale is installed. torch loads every
such entry point whenever anything imports its rendezvous package (Lightning does, on every run), so
this module imports torch's etcd modules only when a handler is built: they need python-etcd and
urllib3 (the ``etcd`` extra), and without them torch would print a traceback on every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

BACKEND = "ddlscale-etcd"
# How long a rendezvous read or write keeps being retried while etcd has no leader. torch's backend
# fails at once on etcd's "request timed out, possibly due to previous leader failure", which a member's
# machine failure causes for the seconds an election takes; every surviving agent then gave up and
# closed the rendezvous, so the job died with the one machine it was meant to survive.
ELECTION_S = 60.0


def _retrying(call: Callable[[], Any], window_s: float = ELECTION_S, pause_s: float = 1.0) -> Any:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    deadline = time.monotonic() + window_s
    while True:
        try:
            return call()
        except RendezvousConnectionError:
            if time.monotonic() + pause_s > deadline:
                raise
            time.sleep(pause_s)


def _backend_class() -> type:
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

    class EveryMemberBackend(EtcdRendezvousBackend):
        """torch's etcd-v2 backend under its own name (torchrun checks that a handler is the one asked for),
        its requests retried through an etcd leader election. A write retried after a lost reply is a
        compare-and-set on a token that no longer matches: the caller gets the current state, as for any
        lost race."""

        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> Any:
            return _retrying(lambda: EtcdRendezvousBackend.get_state(self))

        def set_state(self, state: bytes, token: Any = None) -> Any:
            return _retrying(lambda: EtcdRendezvousBackend.set_state(self, state, token))

    return EveryMemberBackend


def create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    from ddlscale.cluster.control_plane import EtcdAddress

    protocol = params.get("protocol", "http").strip().lower()
    tls = {name: params.get(key) for name, key in (("ca_cert", "ca_cert"), ("cert", "ssl_cert"), ("key", "ssl_cert_key"))
           if params.get(key)}
    scheme = {"http": "etcd", "https": "etcd+https"}.get(protocol)
    if scheme is None:
        raise ValueError(f"--rdzv-conf protocol must be http or https, got {protocol!r}")
    address = EtcdAddress.parse(f"{scheme}://{params.endpoint}")
    address = EtcdAddress(address.endpoints, address.protocol, tls)
    client = address.client(float(params.get_as_int("read_timeout", 60)))
    backend = _backend_class()(client, params.run_id, key_prefix="/torch/elastic/rendezvous")
    return dynamic_handler(EtcdStore(client, "/torch/elastic/store"), backend, params)


def handler() -> Any:
    """The entry point torchrun loads: it returns the function that builds a handler."""
    return create_handler
