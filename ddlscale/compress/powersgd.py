"""PowerSGD: a rank-r approximation from one warm-started power iteration per step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    check_int,
    check_seed,
    float_bytes,
    numel_of,
)

Allreduce = Callable[[torch.Tensor], None]


def orthogonalize_(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p``, in place.

    A column that is (numerically) a combination of earlier ones is set to zero rather than
    normalized: normalizing its rounding noise would yield a direction unrelated to the data,
    and P Q^T would then add a spurious term. A zero column contributes nothing, so a matrix of
    rank below r is still reproduced exactly.
    """
    tolerance = torch.finfo(p.dtype).eps ** 0.5
    for j in range(p.shape[1]):
        col = p[:, j]
        before = torch.linalg.vector_norm(col)
        for i in range(j):
            col -= (p[:, i] @ col) * p[:, i]
        after = torch.linalg.vector_norm(col)
        if after > tolerance * before:
            col /= after
        else:
            col.zero_()
    return p


class PowerSGD(Compressor):
    """A gradient of shape (n, ...) is seen as the matrix M = g.reshape(n, -1) (n x m) and sent as
    two factors: P = orth(M Q) (n x r) and Q' = M^T P (m x r), decoded as P Q'^T = P P^T M, the
    projection of M onto span(P). Q' is kept per tensor name and warm-starts the next step's Q
    (one power iteration per step tracks the slowly changing top subspace); the first Q is drawn
    from (seed, name), identically on every rank.

    Exactness: if M has rank <= r, span(M Q) = col(M) for Q in general position (a random Q is),
    so one step reproduces M up to rounding — no warm-up steps needed. Warm starts only matter for
    matrices of higher rank, where repeated steps converge to the best rank-r approximation.

    Tensors with fewer than 2 dimensions, and matrices where the factors would not be smaller
    ((n + m) r >= n m), pass uncompressed.

    A fused buffer given its members (:class:`Segment`, with their rows) compresses each member as its
    own matrix, one pair of factors each (``name#k`` keys member k's warm start and first Q: given the
    same, bit for bit what that member compressed alone under ``name#k`` gives); a piece that is not
    whole rows of its member cannot be seen as a matrix and is refused (``needs_matrices``: an
    alltoall, which cuts groups into flat partitions, does not take PowerSGD).

    Two ways to use it:
    - ``compress`` / ``decompress``: one rank's own approximation (for gather-style schemes). Not
      summable: factors of different ranks do not add up to factors of the sum.
    - :meth:`reduce`: the allreduce-compatible path, two allreduces of small factors per tensor.
      CompressSync's allreduce scheme runs a fused group through :meth:`reduce_many` with each
      member named by its own tensor, so a tensor's warm-started Q is its own in any group: it
      follows the tensor when a plan (Espresso's, Cupcake's, a re-plan) regroups it.

    Factors travel as float32 (float64 for float64 gradients): a bf16 Gram-Schmidt loses the
    orthogonality the decoding relies on.

    Payload: ``[P (n x r), Q (m x r)]`` with r = min(rank, n, m); uncompressed: ``[g.reshape(-1)]``.
    """

    name = "powersgd"
    per_member, needs_matrices, reduces_itself = True, True, True

    def __init__(self, rank: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.rank = check_int(rank, "compressor.rank", 1)
        self.seed = check_seed(seed)
        self._q: dict[str, torch.Tensor] = {}

    # -- shapes --------------------------------------------------------------------------------
    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """(n, m, r) of the matrix view, or None when the tensor passes uncompressed."""
        if len(shape) < 2 or shape[0] == 0:
            return None
        n = shape[0]
        m = math.prod(shape) // n
        r = min(self.rank, n, m)
        return (n, m, r) if (n + m) * r < n * m else None

    @staticmethod
    def factor_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        if kept is not None:  # factor-sized elements, summed over a fused group's members by the planners
            return kept * float_bytes(self.factor_dtype(dtype))
        dims = self.matrix_shape((shape,) if isinstance(shape, int) else tuple(shape))
        if dims is None:
            return numel_of(shape) * float_bytes(dtype)
        n, m, r = dims
        return (n + m) * r * float_bytes(self.factor_dtype(dtype))

    # -- the two paths -------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        members = segments or (Segment.of(tensor.shape),)
        payload = []
        for k, (member, piece) in enumerate(zip(members, tensor.reshape(-1).split([m.numel for m in members]),
                                                strict=True)):
            dims = self._member_dims(member)
            if dims is None:
                payload.append(piece)
                continue
            matrix = self._matrix(piece, dims)
            key = name if len(members) == 1 else f"{name}#{k}"
            p = orthogonalize_(matrix @ self._warm_q(key, dims, matrix))
            q = matrix.T @ p
            self._q[key] = q
            payload += [p, q]
        return payload, None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        out, at = [], 0
        for member in ctx.members:
            if self._member_dims(member) is None:
                out.append(payload[at].reshape(-1))
                at += 1
            else:
                p, q = payload[at: at + 2]
                out.append((p @ q.T).reshape(-1))
                at += 2
        return out[0] if len(out) == 1 else torch.cat(out)

    def _member_dims(self, member: Segment) -> tuple[int, int, int] | None:
        """(n, m, r) of a member's matrix, None where it passes uncompressed; a piece of a member that
        is not whole rows is refused."""
        if not member.whole_rows:
            raise ValueError(f"powersgd compresses matrices, and was given a piece of one that is not whole rows "
                             f"({member}); use sync.comm=allreduce, allgather or gather")
        if member.cols == 1:  # a vector (or a scalar): passes uncompressed, as a 1-D tensor does
            return None
        return self.matrix_shape((member.rows, member.cols))

    def reduce(self, tensor: torch.Tensor, name: str, allreduce: Allreduce) -> torch.Tensor:
        """Synchronize ``tensor`` across ranks through its factors; return P Q^T in its shape/dtype.

        Steps: P = M Q; allreduce(P); orthogonalize P; Q = M^T P; allreduce(Q); result P Q^T.
        ``allreduce`` reduces a contiguous tensor in place across ranks; the result is the sum or
        the average of the ranks' matrices (projected onto the common span) exactly as that
        callback sums or averages — orthogonalization does not care about P's scale. Every rank
        must call this for the same tensors in the same order (two collectives each; one for a
        tensor that passes uncompressed). For error feedback, give the memory this result as the
        decompressed tensor.
        """
        return self.reduce_many([tensor], [name], allreduce)[0]

    def reduce_many(self, tensors: Sequence[torch.Tensor], names: Sequence[str], allreduce: Allreduce,
                    local: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """:meth:`reduce` for several tensors (a bucket) with at most three collectives in all: the
        uncompressed tensors in one flat allreduce, every tensor's P in one, every Q in one.

        ``local``, if given, receives this rank's own share of each result, P (M^T P)^T with its
        own M before Q is reduced (the tensor itself where uncompressed): what error feedback must
        subtract (Vogels et al.'s e = M - P Q_local^T). The shares sum over ranks to the result.
        """
        dims = [self.matrix_shape(t.shape) for t in tensors]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        plain = [i for i, d in enumerate(dims) if d is None]
        own: list[torch.Tensor | None] = [t for t in tensors]
        if plain:
            flat = torch.cat([tensors[i].reshape(-1) for i in plain])
            allreduce(flat)
            for i, piece in zip(plain, torch.split(flat, [tensors[i].numel() for i in plain]), strict=True):
                out[i] = piece.reshape(tensors[i].shape)
        compressed = [i for i, d in enumerate(dims) if d is not None]
        if compressed:
            matrices = {i: self._matrix(tensors[i], dims[i]) for i in compressed}
            ps = _allreduced([matrices[i] @ self._warm_q(names[i], dims[i], matrices[i]) for i in compressed],
                             allreduce)
            for p in ps:
                orthogonalize_(p)
            local_qs = [matrices[i].T @ p for i, p in zip(compressed, ps, strict=True)]
            for i, p, q in zip(compressed, ps, local_qs, strict=True):
                own[i] = (p @ q.T).reshape(tensors[i].shape).to(tensors[i].dtype)
            qs = _allreduced(local_qs, allreduce)
            for i, p, q in zip(compressed, ps, qs, strict=True):
                self._q[names[i]] = q
                out[i] = (p @ q.T).reshape(tensors[i].shape).to(tensors[i].dtype)
        for name in names:
            self._steps[name] = self._steps.get(name, 0) + 1
        if local is not None:
            local[:] = own
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _matrix(self, tensor: torch.Tensor, dims: tuple[int, int, int]) -> torch.Tensor:
        return tensor.reshape(dims[0], dims[1]).to(self.factor_dtype(tensor.dtype))

    def _warm_q(self, name: str, dims: tuple[int, int, int], matrix: torch.Tensor) -> torch.Tensor:
        """Last step's Q for this tensor, or a fresh shared random one. Columns that collapsed to
        zero (an all-zero gradient) are redrawn: M Q would otherwise stay zero forever."""
        _, m, r = dims
        q = self._q.get(name)
        if q is None or q.shape != (m, r):
            return self._random_q(name, m, r, matrix)
        q = q.to(device=matrix.device, dtype=matrix.dtype)
        dead = torch.linalg.vector_norm(q, dim=0) == 0
        if bool(dead.any()):
            q = q.clone()
            q[:, dead] = self._random_q(name, m, r, matrix)[:, dead]
        return q

    def _random_q(self, name: str, m: int, r: int, matrix: torch.Tensor) -> torch.Tensor:
        gen = self.generator(name, matrix.device, shared=True)
        return torch.randn(m, r, generator=gen, device=matrix.device, dtype=matrix.dtype)

    # -- checkpointed state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._q = {k: v.clone() for k, v in state["q"].items()}


def _allreduced(factors: list[torch.Tensor], allreduce: Allreduce) -> list[torch.Tensor]:
    """Allreduce several factor matrices as one flat buffer; return them (fresh, contiguous)."""
    flat = torch.cat([f.reshape(-1) for f in factors])
    allreduce(flat)
    return [piece.reshape(f.shape).clone() for piece, f in zip(torch.split(flat, [f.numel() for f in factors]),
                                                                  factors, strict=True)]
