"""c10d's TCPStores listening on one address, never on every interface.

torch's TCPStore server binds the wildcard address whatever host name it is given: the store a
process group is made with (rank 0 hosts it in ``init_process_group``), torchrun's rendezvous store,
are then reachable from every network the machine is on, and whoever reaches them can join the
rendezvous or read and write the job's keys. Here the listening socket is made first, bound to the
one address the store is for, and handed to TCPStore (``master_listen_fd``): loopback for a run on
one machine, the machine's own address on the emulated cluster (torchrun's ``--local-addr``, which
becomes ``MASTER_ADDR``). A host name is left to torch (see :func:`init_process_group`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

import torch.distributed as dist

USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def listening_store(host: str, port: int, timeout: datetime.timedelta, world_size: int | None = None,
                    wait_for_workers: bool = False) -> dist.TCPStore:
    """A TCPStore server at ``host:port`` that listens on ``host`` alone (a name: its first address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=512)
    fd = listener.detach()  # the store owns the listening socket from here on
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=fd, use_libuv=True)


def init_process_group(backend: str, rank: int, world_size: int, timeout: datetime.timedelta,
                       **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` as ``env://`` does it (``MASTER_ADDR``, ``MASTER_PORT``),
    rank 0's store listening on ``MASTER_ADDR`` only when that is an IP address: what ddlscale's launchers
    set (127.0.0.1; torchrun's ``--local-addr`` on the emulated cluster). A host name (SLURM's, torchrun's
    default) is left to torch: each machine resolves it for itself, and a host that maps its own name to
    127.0.1.1 (Debian's /etc/hosts) would listen where no other machine connects. Under torchrun's shared
    agent store every rank is its client, as torch does it (that store is torchrun's, not ours to bind)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if not _is_ip(host):
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        return
    if rank == 0 and os.environ.get(USE_AGENT_STORE) != "True":
        store = listening_store(host, port, timeout, world_size, wait_for_workers=True)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # torch's own env:// path keeps the group's keys under this prefix: the same keys as there.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listening_addresses(port: int) -> list[str]:
    """The local addresses something on this host (this network namespace) listens on at TCP ``port``:
    ``127.0.0.1``, ``0.0.0.0`` (every IPv4 interface), ``::`` ... Read from ``/proc/net/tcp{,6}``."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        try:
            with open(f"/proc/net/{name}") as table:
                rows = table.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port and len(address) == width:  # 0A: LISTEN
                # /proc prints each 32-bit word of the address in host (little-endian) order.
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, width, 8))
                found.append(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw))
    return found
