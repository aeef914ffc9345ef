"""The network model (alpha-beta): how long each collective takes on a cluster of machines.

One model serves every system that reasons about time: Zen's choice between its two sparse schemes,
Espresso's per-tensor compression plan, Cupcake's fusion of tensors, Gemini's checkpoint chunks and
the projections to cluster sizes this machine cannot hold. A message step over a link costs

    alpha + bytes * 8 / b

(alpha: per-step latency, b: link bandwidth in bit/s, each direction, full duplex).

**Cluster layout.** ``n`` ranks sit on ``ceil(n / gpus_per_machine)`` machines, placed contiguously
(rank r on machine ``r // gpus_per_machine``). A machine has one NIC of ``bandwidth_bps`` shared by
all its ranks; ranks on the same machine talk over an intra link (NVLink/PCIe) of
``intra_bandwidth_bps`` per rank. Wherever several transfers run at once, a step lasts as long as
its slowest link: the NIC carrying the most bytes, or the busiest intra link.

**Rings across machines.** A ring is laid out machine by machine, so each machine has exactly one
outgoing and one incoming inter-machine edge whatever ``gpus_per_machine`` is; the other edges stay
inside the machine. In each ring step every edge carries one chunk at once, so the step costs
``max(alpha + chunk/b, intra_alpha + chunk/intra_b)`` and a flat ring allreduce puts
``2 (n-1)/n * nbytes`` on every NIC, each way — the same bytes as with one rank per machine, but
with ``2 (n-1)`` latency steps. The saving of hierarchical allreduce is therefore mostly latency.

**Byte counts agree with** :mod:`ddlscale.comm.volume`: with one rank per machine, the beta term
times ``b / 8`` is the per-rank bytes the accounted collectives charge. The model is fluid in one
respect: it splits ``nbytes`` into ``n`` equal real-valued chunks, which equals the *mean* over
ranks of ``volume.ring_allreduce`` for any size and every rank's bytes when ``n`` divides the tensor.

**Sizes.** A size is a number or a 1-D numpy array of them; with an array, a collective's time is
computed for every element at once (one collective per element, equal pieces): the fusion DP prices a
whole row of candidate groups this way. Per-rank piece lists and send matrices are Python sequences.

**Calibration.** ``efficiency[name]`` multiplies the whole time of collective ``name`` (measured /
ideal; gloo's allgather measures 1.7-2.2x the ideal ring), so that a calibration against the
emulated cluster corrects one collective without bending the others.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ddlscale.units import parse_bandwidth, parse_time

BITS_PER_BYTE = 8
PROJECTION_WORKERS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
COLLECTIVES: tuple[str, ...] = (
    "allreduce", "allgather", "all_to_all", "reduce_scatter", "broadcast", "gather", "send",
)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_bytes(nbytes: float | np.ndarray, what: str = "nbytes") -> None:
    if isinstance(nbytes, np.ndarray):
        bad = ~(np.isfinite(nbytes) & (nbytes >= 0))
        if bad.any():
            raise ValueError(f"{what} must be finite numbers >= 0, got {float(nbytes[bad][0])!r}")
    elif not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {nbytes!r}")


def _larger(a: float | np.ndarray, b: float | np.ndarray) -> float | np.ndarray:
    """max(a, b), elementwise where either is an array of sizes' times."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


@dataclass(frozen=True)
class NetworkModel:
    """A cluster of identical machines, as the alpha-beta model sees it.

    ``bandwidth_bps``: one machine's NIC, bit/s each direction (full duplex), shared by its ranks.
    ``latency_s``: alpha, paid once per message step between machines.
    ``gpus_per_machine``: ranks per machine (k). ``intra_bandwidth_bps`` / ``intra_latency_s``: the
    per-rank link inside a machine (default 100x the NIC and 5 us, NVLink-like).
    ``efficiency``: measured/ideal time ratio per collective name (see :data:`COLLECTIVES`); a
    missing name means 1.0.
    """

    bandwidth_bps: float
    latency_s: float
    gpus_per_machine: int = 1
    intra_bandwidth_bps: float | None = None
    intra_latency_s: float = 5e-6
    efficiency: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        def require(ok: bool, key: str, value: object, rule: str) -> None:
            if not ok:
                raise ValueError(f"{key} must be {rule}, got {value!r}")

        require(math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0,
                "cluster.bandwidth", self.bandwidth_bps, "> 0 bit/s")
        require(math.isfinite(self.latency_s) and self.latency_s >= 0,
                "cluster.latency", self.latency_s, ">= 0 s")
        require(isinstance(self.gpus_per_machine, int) and not isinstance(self.gpus_per_machine, bool)
                and self.gpus_per_machine >= 1,
                "cluster.gpus_per_machine", self.gpus_per_machine, "an integer >= 1")
        if self.intra_bandwidth_bps is None:
            object.__setattr__(self, "intra_bandwidth_bps", 100.0 * self.bandwidth_bps)
        require(math.isfinite(self.intra_bandwidth_bps) and self.intra_bandwidth_bps > 0,
                "cluster.intra_bandwidth", self.intra_bandwidth_bps, "> 0 bit/s")
        require(math.isfinite(self.intra_latency_s) and self.intra_latency_s >= 0,
                "cluster.intra_latency", self.intra_latency_s, ">= 0 s")
        for name, factor in self.efficiency.items():
            require(name in COLLECTIVES, "cluster.efficiency", name, f"one of {', '.join(COLLECTIVES)}")
            require(math.isfinite(factor) and factor > 0, f"cluster.efficiency.{name}", factor, "> 0")
        object.__setattr__(self, "efficiency", dict(self.efficiency))  # immune to the caller's dict

    @classmethod
    def of(
        cls,
        bandwidth: str | float = "1gbit",
        latency: str | float = "50us",
        gpus_per_machine: int = 1,
        intra_bandwidth: str | float | None = None,
        intra_latency: str | float = "5us",
        efficiency: dict[str, float] | None = None,
    ) -> NetworkModel:
        """Build from config-style values (``cluster.bandwidth: 1gbit``, ``cluster.latency: 50us``)."""

        def parsed(parse: Callable[[str | float], float], key: str, text: str | float) -> float:
            try:
                return parse(text)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None

        return cls(
            bandwidth_bps=parsed(parse_bandwidth, "cluster.bandwidth", bandwidth),
            latency_s=parsed(parse_time, "cluster.latency", latency),
            gpus_per_machine=gpus_per_machine,
            intra_bandwidth_bps=(
                None if intra_bandwidth is None
                else parsed(parse_bandwidth, "cluster.intra_bandwidth", intra_bandwidth)
            ),
            intra_latency_s=parsed(parse_time, "cluster.intra_latency", intra_latency),
            efficiency=dict(efficiency or {}),
        )

    # -- layout and links ------------------------------------------------------------------------
    def machines(self, n: int) -> int:
        """Machines that ``n`` ranks occupy: ceil(n / gpus_per_machine)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n (ranks) must be an integer >= 1, got {n!r}")
        return -(-n // self.gpus_per_machine)

    def machine_of(self, rank: int) -> int:
        return rank // self.gpus_per_machine

    def _ranks_per_machine(self, n: int) -> int:
        """Ranks on a full machine (all of them when they fit on one)."""
        return min(n, self.gpus_per_machine)

    def _inter(self, nbytes: float) -> float:
        """One message step through a NIC: alpha + bytes * 8 / b."""
        return self.latency_s + nbytes * BITS_PER_BYTE / self.bandwidth_bps

    def _intra(self, nbytes: float) -> float:
        """One message step inside a machine: intra_alpha + bytes * 8 / intra_b."""
        return self.intra_latency_s + nbytes * BITS_PER_BYTE / self.intra_bandwidth_bps

    def _ring_step(self, chunk_bytes: float, n: int) -> float:
        """One step of a ring laid out machine by machine: every edge moves one chunk at once.

        Each machine has one outgoing inter-machine edge, so its NIC carries one chunk; the step
        ends when the slower of the two kinds of edge present is done.
        """
        steps = []
        if self.machines(n) > 1:
            steps.append(self._inter(chunk_bytes))
        if self._ranks_per_machine(n) > 1:
            steps.append(self._intra(chunk_bytes))
        return functools.reduce(_larger, steps)

    def _exchange_step(self, distance: int, block_bytes: Sequence[float]) -> float:
        """One round in which rank r swaps ``block_bytes[r]`` with rank ``r XOR distance``.

        Ranks of one machine whose partners live elsewhere share its NIC, so the round lasts
        alpha + (bytes through the busiest NIC, the larger direction) * 8 / b, or the intra-link
        time of the largest in-machine swap, whichever is longer.
        """
        n = len(block_bytes)
        nic_out = [0.0] * self.machines(n)
        nic_in = [0.0] * self.machines(n)
        crosses = False  # some pair spans two machines this round
        intra_block = None  # largest block swapped inside a machine; None: no such pair
        for rank in range(n):
            peer = rank ^ distance
            here, there = self.machine_of(rank), self.machine_of(peer)
            if here != there:
                crosses = True
                nic_out[here] += block_bytes[rank]
                nic_in[there] += block_bytes[rank]
            else:
                intra_block = max(block_bytes[rank], intra_block or 0.0)
        steps = []
        if crosses:
            steps.append(self._inter(max(max(nic_out), max(nic_in))))
        if intra_block is not None:
            steps.append(self._intra(intra_block))
        return max(steps)

    def _calibrated(self, collective: str, seconds: float) -> float:
        return seconds * self.efficiency.get(collective, 1.0)

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, nbytes: float, n: int, algorithm: str = "ring") -> float:
        """Seconds to allreduce ``nbytes`` per rank over ``n`` ranks.

        - ``ring``: reduce-scatter + allgather, 2(n-1) ring steps of nbytes/n:
          2(n-1) alpha + 2(n-1)/n * nbytes * 8 / b (one rank per machine; see the module doc).
        - ``recursive_doubling``: log2 n rounds, each rank swapping the whole tensor with the rank
          at distance 2^i; rounds that cross machines put k * nbytes through each NIC. ``n`` must
          be a power of two.
        - ``tree``: binomial-tree reduce to rank 0, then binomial-tree broadcast, whole message
          per round, built topology-aware (first inside machines, then across): 2 (ceil(log2 m)
          (alpha + nbytes*8/b) + ceil(log2 k) (intra_alpha + nbytes*8/intra_b)). Latency-bound
          and unpipelined; NCCL's segmented double binary tree is not this.
        - ``hierarchical``: ring reduce-scatter inside each machine, then k concurrent ring
          allreduces of nbytes/k across the m machines (one per local rank; together they put
          2(m-1)/m * nbytes through each NIC), then ring allgather inside each machine:
          2(k-1) (intra_alpha + nbytes/k*8/intra_b) + 2(m-1) (alpha + nbytes/m*8/b).
          ``n`` must be a multiple of k (or at most k).
        """
        _check_bytes(nbytes)
        machines, local = self.machines(n), self._ranks_per_machine(n)
        if n == 1:
            return 0.0
        if algorithm == "ring":
            seconds = 2 * (n - 1) * self._ring_step(nbytes / n, n)
        elif algorithm == "recursive_doubling":
            if not _is_power_of_two(n):
                raise ValueError(f"recursive_doubling needs a power-of-two n, got {n}")
            blocks = [float(nbytes)] * n
            seconds = sum(self._exchange_step(1 << i, blocks) for i in range(n.bit_length() - 1))
        elif algorithm == "tree":
            seconds = 2 * self._tree_time(nbytes, machines, local)
        elif algorithm == "hierarchical":
            if n % local:
                raise ValueError(
                    f"hierarchical allreduce needs n a multiple of gpus_per_machine "
                    f"({self.gpus_per_machine}), got {n}"
                )
            intra = 2 * (local - 1) * self._intra(nbytes / local) if local > 1 else 0.0
            inter = 2 * (machines - 1) * self._inter(nbytes / machines) if machines > 1 else 0.0
            seconds = intra + inter
        else:
            raise ValueError(
                f"unknown allreduce algorithm {algorithm!r} (ring, recursive_doubling, tree, hierarchical)"
            )
        return self._calibrated("allreduce", seconds)

    def _tree_time(self, nbytes: float, machines: int, local: int) -> float:
        """A binomial tree over machines and one inside each: ceil(log2) whole-message rounds each."""
        rounds_across = math.ceil(math.log2(machines)) if machines > 1 else 0
        rounds_inside = math.ceil(math.log2(local)) if local > 1 else 0
        return rounds_across * self._inter(nbytes) + rounds_inside * self._intra(nbytes)

    def allgather(self, piece_bytes: Sequence[float] | float, n: int, algorithm: str = "ring") -> float:
        """Seconds for every rank to obtain every rank's piece.

        ``piece_bytes``: one size for all ranks, or one per rank. Ranks move in lock step and a
        step lasts as long as its largest message, so uneven pieces cost what padding them to the
        longest costs — exactly the bytes ``Communicator.allgather_uneven`` charges.

        - ``ring``: n-1 ring steps, each moving every piece one hop:
          (n-1) (alpha + max_piece * 8 / b); with equal pieces (n-1) * piece bytes per rank, as in
          ``volume.ring_allgather``.
        - ``recursive_doubling``: log2 n rounds; in round i each rank swaps the 2^i pieces it has
          gathered so far with the rank at distance 2^i. ``n`` must be a power of two.
        - ``direct``: every rank sends its piece to every other at once (``Communicator`` on gloo
          for large pieces): an all-to-all whose row i is piece i, priced as :meth:`all_to_all`.

        An array of sizes prices one ring allgather of equal pieces per element.
        """
        if isinstance(piece_bytes, np.ndarray):
            _check_bytes(piece_bytes, "piece_bytes")
            self.machines(n)
            if algorithm != "ring":
                raise ValueError(f"allgather of an array of sizes is priced for the ring only, not {algorithm!r}")
            return 0.0 if n == 1 else self._calibrated("allgather", (n - 1) * self._ring_step(piece_bytes, n))
        pieces = self._pieces(piece_bytes, n)
        if n == 1:
            return 0.0
        if algorithm == "ring":
            seconds = (n - 1) * self._ring_step(max(pieces), n)
        elif algorithm == "recursive_doubling":
            if not _is_power_of_two(n):
                raise ValueError(f"recursive_doubling needs a power-of-two n, got {n}")
            prefix = [0.0, *itertools.accumulate(pieces)]
            seconds = 0.0
            for i in range(n.bit_length() - 1):
                span = 1 << i  # after i rounds rank r holds the pieces of its aligned group of 2^i
                blocks = [prefix[r - r % span + span] - prefix[r - r % span] for r in range(n)]
                seconds += self._exchange_step(span, blocks)
        elif algorithm == "direct":
            return self._calibrated("allgather", self._pairwise([[p] * n for p in pieces]))
        else:
            raise ValueError(f"unknown allgather algorithm {algorithm!r} (ring, recursive_doubling, direct)")
        return self._calibrated("allgather", seconds)

    def _pieces(self, piece_bytes: Sequence[float] | float, n: int) -> list[float]:
        self.machines(n)  # validates n
        if isinstance(piece_bytes, int | float):
            pieces = [float(piece_bytes)] * n
        else:
            pieces = [float(p) for p in piece_bytes]
            if len(pieces) != n:
                raise ValueError(f"piece_bytes has {len(pieces)} entries for n={n} ranks")
        for p in pieces:
            _check_bytes(p, "piece_bytes")
        return pieces

    def all_to_all(self, send_matrix_bytes: Sequence[Sequence[float]] | float, n: int | None = None) -> float:
        """Seconds for a pairwise-exchange all-to-all; ``send_matrix_bytes[i][j]``: rank i -> rank j.

        A single number means every rank sends that many bytes to every other rank (then ``n`` is
        required). Pairwise exchange runs n-1 rounds; the busiest link decides the bytes term:

            (n-1) alpha + max( max over machines of max(bytes leaving, bytes entering) * 8 / b,
                               max over ranks of max(intra bytes out, intra bytes in) * 8 / intra_b )

        Blocks between ranks of one machine use the intra link; a rank's block to itself never
        travels (as in ``volume.all_to_all``). All on one machine, alpha is the intra latency.
        """
        if isinstance(send_matrix_bytes, int | float | np.ndarray):
            if n is None:
                raise ValueError("all_to_all with a uniform block size needs n")
            uniform = send_matrix_bytes if isinstance(send_matrix_bytes, np.ndarray) else float(send_matrix_bytes)
            return self._uniform_all_to_all(uniform, n)
        matrix = [[float(b) for b in row] for row in send_matrix_bytes]
        size = len(matrix)
        if (n is not None and n != size) or any(len(row) != size for row in matrix):
            raise ValueError(f"send matrix must be {n or size}x{n or size}")
        return self._calibrated("all_to_all", self._pairwise(matrix))

    def _pairwise(self, matrix: list[list[float]]) -> float:
        """Uncalibrated seconds of a pairwise exchange with send matrix ``matrix`` (see all_to_all)."""
        size = len(matrix)
        machines = self.machines(size)
        if size == 1:
            return 0.0
        nic_out, nic_in = [0.0] * machines, [0.0] * machines
        link_out, link_in = [0.0] * size, [0.0] * size
        messages = []
        for src, row in enumerate(matrix):
            for dst, nbytes in enumerate(row):
                _check_bytes(nbytes, "send_matrix_bytes")
                if src == dst:
                    continue
                messages.append(nbytes)
                if self.machine_of(src) != self.machine_of(dst):
                    nic_out[self.machine_of(src)] += nbytes
                    nic_in[self.machine_of(dst)] += nbytes
                else:
                    link_out[src] += nbytes
                    link_in[dst] += nbytes
        return self._all_to_all_time(
            size, max(max(nic_out), max(nic_in)), max(max(link_out), max(link_in))
        )

    def _uniform_all_to_all(self, block_bytes: float, n: int) -> float:
        """Every rank sends ``block_bytes`` to every other: a full machine's NIC carries k (n-k) blocks."""
        _check_bytes(block_bytes, "block bytes")
        local = self._ranks_per_machine(n)
        if n == 1:
            return 0.0
        seconds = self._all_to_all_time(n, local * (n - local) * block_bytes, (local - 1) * block_bytes)
        return self._calibrated("all_to_all", seconds)

    def _all_to_all_time(self, n: int, busiest_nic_bytes: float, busiest_link_bytes: float) -> float:
        across = self.machines(n) > 1
        alpha = self.latency_s if across else self.intra_latency_s
        transfer = _larger(
            busiest_nic_bytes * BITS_PER_BYTE / self.bandwidth_bps,
            busiest_link_bytes * BITS_PER_BYTE / self.intra_bandwidth_bps,
        )
        return (n - 1) * alpha + transfer

    def reduce_scatter(self, nbytes: float, n: int) -> float:
        """Seconds for a ring reduce-scatter of ``nbytes`` per rank (n chunks; each rank keeps one).

        (n-1) ring steps of nbytes/n: (n-1) alpha + (n-1)/n * nbytes * 8 / b — the bytes of
        ``volume.ring_reduce_scatter(nbytes / n, n)``.
        """
        _check_bytes(nbytes)
        self.machines(n)
        if n == 1:
            return 0.0
        return self._calibrated("reduce_scatter", (n - 1) * self._ring_step(nbytes / n, n))

    def broadcast(self, nbytes: float, n: int, algorithm: str = "flat", root: int = 0) -> float:
        """Seconds to send ``nbytes`` from ``root`` to all ranks.

        - ``flat``: the root sends the whole tensor to each other rank in turn (gloo's model and
          ``volume.flat_broadcast``'s bytes); its NIC and its intra link work side by side:
          max(r (alpha + nbytes*8/b), l (intra_alpha + nbytes*8/intra_b)) for r remote ranks and
          l other ranks on the root's machine.
        - ``tree``: binomial tree across machines, then inside them, whole message per round:
          ceil(log2 m) (alpha + nbytes*8/b) + ceil(log2 k) (intra_alpha + nbytes*8/intra_b).
        """
        _check_bytes(nbytes)
        machines, local = self.machines(n), self._ranks_per_machine(n)
        if n == 1:
            return 0.0
        if algorithm == "flat" and isinstance(nbytes, np.ndarray):
            seconds = self._rooted_uniform(nbytes, n, root)
        elif algorithm == "flat":
            seconds = self._rooted([float(nbytes)] * n, root)
        elif algorithm == "tree":
            seconds = self._tree_time(nbytes, machines, local)
        else:
            raise ValueError(f"unknown broadcast algorithm {algorithm!r} (flat, tree)")
        return self._calibrated("broadcast", seconds)

    def gather(self, piece_bytes: Sequence[float] | float, n: int, root: int = 0) -> float:
        """Seconds for every rank to send its piece straight to ``root`` (``volume.flat_gather``).

        The root's NIC takes the remote pieces one message each and its intra link the local ones,
        side by side: max(r alpha + remote bytes*8/b, l intra_alpha + local bytes*8/intra_b).
        An array of sizes prices one gather of equal pieces per element.
        """
        if isinstance(piece_bytes, np.ndarray):
            _check_bytes(piece_bytes, "piece_bytes")
            self.machines(n)
            return 0.0 if n == 1 else self._calibrated("gather", self._rooted_uniform(piece_bytes, n, root))
        pieces = self._pieces(piece_bytes, n)
        if n == 1:
            return 0.0
        return self._calibrated("gather", self._rooted(pieces, root))

    def _rooted(self, message_bytes: list[float], root: int) -> float:
        """One message between ``root`` and every other rank, serialized at the root per link kind."""
        n = len(message_bytes)
        if not 0 <= root < n:
            raise ValueError(f"root must be a rank in [0, {n}), got {root}")
        home = self.machine_of(root)
        remote = [b for r, b in enumerate(message_bytes) if self.machine_of(r) != home]
        local = [b for r, b in enumerate(message_bytes) if self.machine_of(r) == home and r != root]
        across = len(remote) * self.latency_s + sum(remote) * BITS_PER_BYTE / self.bandwidth_bps
        inside = len(local) * self.intra_latency_s + sum(local) * BITS_PER_BYTE / self.intra_bandwidth_bps
        return max(across, inside)

    def _rooted_uniform(self, nbytes: np.ndarray, n: int, root: int) -> np.ndarray:
        """:meth:`_rooted` of ``n`` equal messages, for every size of ``nbytes`` at once."""
        if not 0 <= root < n:
            raise ValueError(f"root must be a rank in [0, {n}), got {root}")
        remote = sum(self.machine_of(r) != self.machine_of(root) for r in range(n))
        local = n - 1 - remote
        across = remote * self.latency_s + remote * nbytes * BITS_PER_BYTE / self.bandwidth_bps
        inside = local * self.intra_latency_s + local * nbytes * BITS_PER_BYTE / self.intra_bandwidth_bps
        return np.maximum(across, inside)

    def send(self, nbytes: float, same_machine: bool = False) -> float:
        """Seconds for one point-to-point message: alpha + nbytes * 8 / b (Gemini's chunk time)."""
        _check_bytes(nbytes)
        seconds = self._intra(nbytes) if same_machine else self._inter(nbytes)
        return self._calibrated("send", seconds)

    def time(self, collective: str, nbytes: float, n: int, algorithm: str | None = None) -> float:
        """Seconds of ``collective`` by name, with ``nbytes`` what each rank contributes.

        allreduce / reduce_scatter / broadcast: the tensor; allgather / gather: each rank's piece;
        all_to_all: each rank's send buffer, split evenly over the n ranks; send: the message.
        """
        options = {} if algorithm is None else {"algorithm": algorithm}
        if collective == "allreduce":
            return self.allreduce(nbytes, n, **options)
        if collective == "allgather":
            return self.allgather(nbytes, n, **options)
        if collective == "broadcast":
            return self.broadcast(nbytes, n, **options)
        if algorithm is not None:
            raise ValueError(f"{collective} has no algorithm choice, got {algorithm!r}")
        if collective == "reduce_scatter":
            return self.reduce_scatter(nbytes, n)
        if collective == "gather":
            return self.gather(nbytes, n)
        if collective == "all_to_all":
            return self.all_to_all(nbytes / n, n)
        if collective == "send":
            return self.send(nbytes)
        raise ValueError(f"unknown collective {collective!r} (one of {', '.join(COLLECTIVES)})")


def project(
    nbytes: float,
    collective: str,
    workers: Sequence[int] = PROJECTION_WORKERS,
    *,
    model: NetworkModel,
    algorithm: str | None = None,
) -> list[tuple[int, float]]:
    """``(n, seconds)`` of one collective at each cluster size, for sizes this machine cannot hold.

    Trust a projection only where the model was checked against the emulated cluster (2-8 machines).
    """
    return [(n, model.time(collective, nbytes, n, algorithm)) for n in workers]
