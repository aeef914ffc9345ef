"""A process-group store of its own for every torchrun round, so that restarts work.

torchrun's c10d rendezvous hands its workers a *shared* store (``TORCHELASTIC_USE_AGENT_STORE=True``):
one TCPStore, hosted by the node-0 agent, that outlives every restart. The keys of the previous round's
process group are still in it when a restarted round starts — the gloo peers' addresses among them —
so a restarted worker reads a dead peer's address and fails or waits out its timeout (7 minutes
between emulated machines). torch isolates rounds by ``TORCHELASTIC_RESTART_COUNT``, but each agent
counts its own restarts (pytorch/pytorch#135712), and torchrun's remedy,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, must be in every torchrun's environment, not the worker's.

So the workers of each round agree on a fresh store themselves, through the shared one: rank 0 picks a
free port and answers every other rank's fresh random hello with it; each rank waits for the answer to
*its own* hello, so nothing left over from an earlier round can be mistaken for this round's. Then,
as with sharing turned off, rank 0 hosts the process group's store on that port, created with the
group and gone with it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import uuid
from collections.abc import Iterator

import torch.distributed as dist

USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
PREFIX = "ddlscale/pg-round"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _answer_hellos(store: dist.TCPStore, world_size: int, port: int, stop: threading.Event) -> None:
    """Rank 0: tell every rank that says hello (a fresh nonce per round) the port of this round's store."""
    answered: set[bytes] = set()
    hellos = [f"{PREFIX}/hello/{r}" for r in range(1, world_size)]
    while not stop.wait(0.01):
        for key in hellos:
            if store.check([key]) and (nonce := store.get(key)) not in answered:
                store.set(f"{PREFIX}/port/{nonce.decode()}", str(port))
                answered.add(nonce)


@contextlib.contextmanager
def store_per_round(rank: int, world_size: int, timeout: datetime.timedelta) -> Iterator[None]:
    """Around process-group creation under torchrun: point ``MASTER_PORT`` at a store of this round.

    Does nothing unless torchrun shares its agent store with the workers.
    """
    if os.environ.get(USE_AGENT_STORE) != "True" or world_size < 2:
        yield
        return
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           wait_for_workers=False, timeout=timeout)
    stop = threading.Event()
    responder = None
    if rank == 0:
        port = _free_port()
        responder = threading.Thread(target=_answer_hellos, args=(shared, world_size, port, stop), daemon=True)
        responder.start()
    else:
        nonce = uuid.uuid4().hex
        shared.set(f"{PREFIX}/hello/{rank}", nonce)
        shared.wait([f"{PREFIX}/port/{nonce}"], timeout)
        port = int(shared.get(f"{PREFIX}/port/{nonce}"))
    os.environ[USE_AGENT_STORE] = "False"  # rank 0 hosts the store, as with sharing turned off
    os.environ["MASTER_PORT"] = str(port)
    try:
        yield  # every rank joins the group here, so rank 0 has answered them all when it returns
    finally:
        stop.set()
        if responder is not None:
            responder.join(timeout=5)
