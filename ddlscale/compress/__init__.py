"""Gradient compressors and error-feedback memories (GRACE's split: Compressor / Memory / scheme).

A compressor knows how to encode one tensor; a memory knows what to add back; an aggregation
scheme (a sync backend) knows who sends what to whom. Each lives apart, so any compressor runs
under any memory and any scheme its properties allow.

The interface a backend relies on
---------------------------------
``Compressor`` (``compressor.py``)::

    precondition(tensor, name, segments=None, ranks=1) -> Tensor  # once per step and group, first
    precondition_dense(tensor, name) -> Tensor            # instead, for a group a planned sync sends dense
    compress(tensor: Tensor, name: str = "", segments: Sequence[int | Segment] | None = None) -> Compressed
    decompress(compressed: Compressed) -> Tensor          # original shape and dtype
    decompress_sum(items: Sequence[Compressed]) -> Tensor  # decompress each, add in order
    combine(total: Tensor, count: int) -> Tensor          # what the sum of count ranks' tensors aggregates to
    sent(name: str, decoded: Tensor) -> None              # after the step: what this rank's first stage sent
    aggregate(items: Sequence[Compressed]) -> Compressed  # only where ``summable``
    payload_bytes(shape: int | Sequence[int], dtype: torch.dtype, kept: int | None = None) -> int
    state_dict() -> dict;  load_state_dict(state: dict) -> None
    summable: bool        # payloads of different ranks may be summed elementwise, then decoded
    fixed_size: bool      # payload shapes depend only on (shape, dtype); else exchange sizes first
    per_member: bool      # treats each member of a fused buffer given its ``segments`` as alone
    needs_matrices: bool  # compresses matrices (PowerSGD): never hand it pieces cutting rows
    default_memory: str   # the error feedback a run gets unless it names one: residual if biased
    votes: bool           # combine is a majority vote: no error feedback, no owner re-encoding
    reduces_itself: bool  # runs its own collectives under allreduce (PowerSGD's power iteration)
    wire_dtype: dtype | None  # a cast's wire type; shared_scale: bool  # ranks agree on a scale first

``Compressed(payload: list[Tensor], ctx: Context)``: ``payload`` is exactly what travels (its
``nbytes`` equals ``payload_bytes``, indices and scales included); ``Context(shape, dtype, extra,
segments)`` stays on the rank. ``with_payload(received)`` pairs another rank's payload with this
rank's context.

Rules:
1. A Context is rank-independent: for the same tensor name and step, every rank's Context decodes
   every rank's payload. So a receiver compresses its own copy of the tensor (every scheme does)
   and decodes others' payloads with ``mine.with_payload(theirs)`` — nothing but payload tensors
   travels. (Only randomk with a shared seed puts data in ``extra``: its indices, identical on
   every rank by construction.)
2. ``name`` keys per-tensor state (momentum, PowerSGD's Q, residuals, random streams); every rank
   must compress the same names the same number of times, in any order.
3. Randomness is drawn from (seed, rank, name, step) with a stable hash — never from the global
   RNG — so it is reproducible and restored by ``load_state_dict``. Shared draws (randomk's
   indices with a seed, PowerSGD's first Q) leave the rank out; the rank comes from
   ``torch.distributed`` when it is initialized.
4. Summable payloads (none, fp16, bf16, randomk with ``seed``) may be allreduced. A sum of fp16
   payloads can overflow: divide by the world size before compressing, not after.
5. Variable-size compressors (``fixed_size = False``: threshold, dgc) put the values first:
   ``payload[0].numel()`` is the ``kept`` count that ``payload_bytes`` takes.
6. ``decompress`` returns a new tensor except for pass-through payloads (none, PowerSGD's
   vectors), which may alias the input; so may ``payload`` itself for those.
7. PowerSGD adds ``reduce(tensor, name, allreduce: Callable[[Tensor], None]) -> Tensor``, the
   allreduce-compatible path (two in-place allreduces of the factors).
8. A fused group's flat buffer comes with ``segments``, its members (:class:`Segment`: size, and
   the row length of the member's matrix view), or the pieces of them a partition holds. A
   per-member compressor keeps its per-tensor statistics per member — int8's and the scaled signs'
   scale, QSGD's buckets, TernGrad's sigma and s (shared over ranks member by member), the unscaled
   signs' zero-row bits, onebit's column means, PowerSGD's factors; randomk draws each member's own
   k positions — and records them in the Context, so the group decodes bit for bit as its members
   compressed alone would (a stochastic one: given the same draws, :meth:`Compressor.uniform`). The
   payload grows by at most ``member_bytes`` per extra member (onebit: per extra column; unscaled
   signs: a bit per row). Every other compressor ignores them: elementwise ones (casts, threshold)
   are unchanged by fusion anyway, and top-k and DGC select over the whole group by design.
9. Parameters are checked at construction; a bad one raises ValueError naming its config key
   (``compressor.ratio must be in (0, 1], got 1.5``).
10. ``precondition`` runs once per step on each group's gradient, before error feedback (DGC's
   momentum correction and clipping, Signum's momentum), and ``sent`` after the step with what
   this rank's first compression sent; a scheme's second compression (an owner's re-encoding of a
   sum) goes through ``compress`` alone. A group a planned sync sends uncompressed (its dense
   steps, a plan's dense groups) goes through the configured compressor's ``precondition_dense``
   instead (DGC: the optimizer's momentum it took over), and ``agreed`` (TernGrad's shared scales)
   wraps each group's first-stage compressions, given the group's segments.

``Memory`` (``memory.py``)::

    compensate(tensor: Tensor, name: str) -> Tensor       # p = g + e (float32 or wider)
    update(name: str, compensated: Tensor, decompressed: Tensor) -> None
    residual(name: str) -> Tensor | None
    forget(name: str) -> None                             # sent whole: no error to carry
    group_states() -> list[dict[str, Tensor]]             # per-name tensors a regrouping re-lays out
    state_dict() -> dict;  load_state_dict(state: dict) -> None

Compressor names are their config files, ``ddlscale/conf/compressor/<name>.yaml`` (:mod:`.registry`:
:data:`COMPRESSORS`, :func:`build_compressor`); a name that is a configuration of another's class
(``signum``, ``efsignsgd``: :class:`SignSGD`) has its settings there and nowhere else. Memories are
listed in :data:`MEMORIES` (``ddlscale/conf/memory/<name>.yaml`` target them).
"""

from __future__ import annotations

from typing import Any

from ddlscale.compress.cast import BF16, FP16
from ddlscale.compress.compressor import Compressed, Compressor, Context, Segment
from ddlscale.compress.dgc import DGC
from ddlscale.compress.int8 import Int8
from ddlscale.compress.memory import MEMORIES, DecayedMemory, Memory, NoMemory, ResidualMemory
from ddlscale.compress.none import NoCompression
from ddlscale.compress.onebit import OneBit
from ddlscale.compress.powersgd import PowerSGD
from ddlscale.compress.qsgd import QSGD
from ddlscale.compress.randomk import RandomK
from ddlscale.compress.registry import COMPRESSORS, build_compressor, class_path
from ddlscale.compress.signsgd import SignSGD
from ddlscale.compress.terngrad import TernGrad
from ddlscale.compress.threshold import Threshold
from ddlscale.compress.topk import TopK


def build_memory(name: str, **params: Any) -> Memory:
    if name not in MEMORIES:
        raise ValueError(f"memory must be one of {', '.join(MEMORIES)}; got {name!r}")
    return MEMORIES[name](**params)


__all__ = [
    "BF16", "COMPRESSORS", "DGC", "FP16", "Int8", "MEMORIES", "NoCompression", "NoMemory",
    "OneBit", "PowerSGD", "QSGD", "RandomK", "SignSGD", "TernGrad", "Threshold", "TopK",
    "Compressed", "Compressor", "Context", "DecayedMemory", "Memory", "ResidualMemory", "Segment",
    "build_compressor", "build_memory", "class_path",
]
