"""The iteration simulator: when each gradient is encoded, sent and decoded, and when the step ends.

Espresso scores a compression plan and Cupcake a fusion plan by the iteration time this model
predicts; Gemini reads the idle spans of the communication stream from it. Times are seconds from
the start of backward. Three resources run side by side:

- the *compute stream* runs backward, producing tensor i's gradient at ``ready_s``;
- the *communication stream* sends tensors one at a time, in backward order;
- the *side stream* (a CPU thread or a second CUDA stream) encodes and decodes tensors whose
  ``encode_on_compute`` is false, one job at a time, each job in the order it became runnable.

Tensor i, with D_i the compute time stolen by compute-stream encodes/decodes of earlier tensors:

    ready'_i     = ready_i + D_i
    encode_start = max(ready'_i, end of the previous job on its stream)
    comm_start   = max(encode_end + lag_i, comm_end_{i-1});   comm_end = comm_start + comm_i
    decode_end   = max(comm_end, side stream free) + decode_i      (side stream)
                 = comm_end + decode_i                              (compute stream)
    iteration    = max(backward_end + D_N, max_i decode_end) + optimizer

The simulated rank is one of n: a collective starts when the last rank issues it, ``lag_i`` after
this one (the slowest rank's backward runs behind; 0 for a rank that never waits).

A compute-stream tensor (GPU compression) charges ``encode_s + decode_s`` to the compute stream at
once: every later gradient and the backward end move by that much — Espresso's model. This is
exact for the decode when its communication ends after backward (it then runs right after backward
and ends at max(backward_end', comm_end) + decode either way); when it ends during backward the
decode delays a few gradients produced before it actually ran. A zero-length encode or decode
needs no stream and waits for none.

Without encoding and decoding this reduces to the recursion in SYSTEMS.md,
``finish_i = max(finish_{i-1}, ready_i) + comp_i + comm_i``, when compression shares the
communication stream: pass ``comm_s = comp_i + comm_i`` and zero encode/decode times. A separate
side stream is the more optimistic case in which encoding tensor i overlaps sending tensor i-1.
Every tensor is visited once, and each decode once, so a simulation is O(N).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorTask:
    """One gradient tensor to synchronize, in backward order.

    ``ready_s``: when backward produced it (seconds after backward starts). ``encode_s``,
    ``comm_s``, ``decode_s``: its compression, communication and decompression times (0 when not
    compressed). ``encode_on_compute``: encode/decode run on the compute stream (GPU compression
    that steals compute from backward) instead of the side stream. ``lag_s``: how much later the
    slowest rank is ready to send it (the collective waits for every rank).
    """

    name: str
    ready_s: float
    encode_s: float
    comm_s: float
    decode_s: float
    encode_on_compute: bool = False
    lag_s: float = 0.0


@dataclass(frozen=True)
class TensorSpan:
    """When one tensor's work happened; ``ready`` includes the delays of compute-stream encodes."""

    name: str
    ready: float
    encode_start: float
    encode_end: float
    comm_start: float
    comm_end: float
    decode_start: float
    decode_end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated iteration (backward start = 0).

    ``backward_end_s`` includes the compute stolen by compute-stream encodes/decodes;
    ``comm_busy`` lists the disjoint (start, end) spans in which the communication stream is busy,
    touching spans merged.
    """

    tensors: tuple[TensorSpan, ...]
    backward_end_s: float
    optimizer_s: float
    iteration_s: float
    comm_busy: tuple[tuple[float, float], ...]

    def idle_gaps(self, min_s: float = 0.0) -> list[tuple[float, float]]:
        """The (start, end) spans of [0, iteration_s] with no communication, at least ``min_s`` long.

        Includes the span before the first message (backward of the last layers) and the one after
        the last (decode, optimizer): Gemini can fill both with checkpoint traffic. The forward pass
        of the next iteration is not part of this timeline. Empty spans are never returned.
        """
        gaps = []
        cursor = 0.0
        for start, end in (*self.comm_busy, (self.iteration_s, self.iteration_s)):
            length = start - cursor
            if length > 0 and length >= min_s:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        return gaps


def _check_duration(value: float, what: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")


def _check_tasks(tasks: Sequence[TensorTask], backward_end_s: float, optimizer_s: float) -> None:
    _check_duration(backward_end_s, "backward_end_s")
    _check_duration(optimizer_s, "optimizer_s")
    for task in tasks:
        for what in ("ready_s", "encode_s", "comm_s", "decode_s", "lag_s"):
            _check_duration(getattr(task, what), f"{task.name}.{what}")
        if task.ready_s > backward_end_s:
            raise ValueError(f"{task.name}.ready_s ({task.ready_s}) is after backward_end_s ({backward_end_s})")


def simulate(tasks: Sequence[TensorTask], backward_end_s: float, optimizer_s: float = 0.0,
             check: bool = True) -> Timeline:
    """Simulate one iteration of ``tasks`` (in backward order); see the module doc for the model.
    ``check=False`` skips validating the inputs (the caller built them)."""
    if check:
        _check_tasks(tasks, backward_end_s, optimizer_s)
    times, stolen = _schedule(tasks)
    backward_end = backward_end_s + stolen
    iteration = max([backward_end, *times[6]]) + optimizer_s
    spans = tuple(TensorSpan(t.name, *(column[i] for column in times)) for i, t in enumerate(tasks))
    return Timeline(spans, backward_end, optimizer_s, iteration,
                    merged_busy([(span.comm_start, span.comm_end) for span in spans]))


def iteration_time(tasks: Sequence[TensorTask], backward_end_s: float, optimizer_s: float = 0.0,
                   check: bool = True) -> float:
    """``simulate(...).iteration_s`` without building the spans: what a plan search evaluates
    thousands of times. ``check=False`` skips validating the inputs (the caller built them)."""
    if check:
        _check_tasks(tasks, backward_end_s, optimizer_s)
    times, stolen = _schedule(tasks)
    return max([backward_end_s + stolen, *times[6]]) + optimizer_s


def _schedule(tasks: Sequence[TensorTask]) -> tuple[tuple[list[float], ...], float]:
    """The recursion of the module doc: per task (ready, encode start/end, comm start/end, decode
    start/end) as seven columns, and the compute time stolen by compute-stream jobs."""
    count = len(tasks)
    ready = [0.0] * count
    encode_start, encode_end = [0.0] * count, [0.0] * count
    comm_start, comm_end = [0.0] * count, [0.0] * count
    decode_start, decode_end = [0.0] * count, [0.0] * count

    stolen = 0.0  # compute time taken from backward by compute-stream encodes/decodes so far
    compute_free = side_free = comm_free = 0.0
    undecoded: deque[int] = deque()  # side-stream tensors sent but not yet decoded, in send order

    def decode_on_side_stream(j: int) -> None:
        nonlocal side_free
        decode_start[j] = max(side_free, comm_end[j])
        decode_end[j] = decode_start[j] + tasks[j].decode_s
        side_free = decode_end[j]

    for i, task in enumerate(tasks):
        ready[i] = task.ready_s + stolen
        if task.encode_on_compute:
            encode_start[i] = max(ready[i], compute_free) if task.encode_s > 0 else ready[i]
            encode_end[i] = encode_start[i] + task.encode_s
            compute_free = max(compute_free, encode_end[i])
            stolen += task.encode_s + task.decode_s
        elif task.encode_s > 0:
            # The side stream serves jobs in the order they became runnable: decodes whose message
            # arrived no later than this gradient go first.
            while undecoded and comm_end[undecoded[0]] <= ready[i]:
                decode_on_side_stream(undecoded.popleft())
            encode_start[i] = max(ready[i], side_free)
            encode_end[i] = side_free = encode_start[i] + task.encode_s
        else:
            encode_start[i] = encode_end[i] = ready[i]

        comm_start[i] = max(encode_end[i] + task.lag_s, comm_free)
        comm_end[i] = comm_free = comm_start[i] + task.comm_s

        if task.encode_on_compute or task.decode_s == 0:
            decode_start[i] = comm_end[i]
            decode_end[i] = comm_end[i] + task.decode_s
        else:
            undecoded.append(i)
    while undecoded:
        decode_on_side_stream(undecoded.popleft())
    return (ready, encode_start, encode_end, comm_start, comm_end, decode_start, decode_end), stolen


def merged_busy(comm: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The communication stream's busy spans from each message's (start, end); messages are sent in
    order, so one pass merges them."""
    busy: list[tuple[float, float]] = []
    for start, end in comm:
        if end <= start:
            continue
        if busy and start <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], end))
        else:
            busy.append((start, end))
    return tuple(busy)


class Swaps:
    """The iteration time of a plan with a few of its tasks swapped, without simulating it all again.

    A plan search scores thousands of plans that differ from the current one in one or two tasks.
    When every task runs on the compute stream (or has no encode and decode) and ready times never
    decrease, the simulation is a max-plus recursion over the state before task i — communication
    stream end C, stolen compute S, latest decode end M — and the tasks from k on act on it through
    two numbers (alpha_k, beta_k) (the suffix constants of :mod:`ddlscale.plan.cupcake`):

        iteration = max(M, C + alpha_k, S + beta_k) + optimizer

    So with the states of the current plan kept for every i and the constants for every k, a plan
    that differs in one task costs O(1); between two changed tasks the unchanged ones act on the
    state as one max-plus map (see :meth:`_span`), built once per span and reused. ``time`` equals
    :func:`iteration_time` up to float rounding (the tests check both on random plans).
    Build it with :meth:`of`, which says when a plan does not qualify.
    """

    def __init__(self, tasks: Sequence[TensorTask], backward_end_s: float, optimizer_s: float = 0.0):
        self.tasks, self.optimizer_s = list(tasks), optimizer_s
        count = len(tasks)
        # states[i]: (C, S, M) before task i; comm[i]: the plan's message i as (start, end).
        self.states = [(0.0, 0.0, -math.inf)] * (count + 1)
        for i, task in enumerate(tasks):
            self.states[i + 1] = _compute_step(self.states[i], task)
        self.comm = [(_message_start(before, task), after[0])
                     for task, before, after in zip(tasks, self.states, self.states[1:], strict=False)]
        _, stolen, last_decode = self.states[count]
        self.backward_end_s = backward_end_s + stolen  # with the compute every task took
        self.last_decode_s = max(last_decode, 0.0)
        # alpha[k], beta[k]: the constants of tasks k..N-1 (the empty suffix: -inf, backward end).
        self.alpha, self.beta = [-math.inf] * (count + 1), [float(backward_end_s)] * (count + 1)
        for k in range(count - 1, -1, -1):
            t = tasks[k]
            self.alpha[k] = t.comm_s + max(t.decode_s, self.alpha[k + 1])
            self.beta[k] = max(t.ready_s + t.lag_s + t.encode_s + self.alpha[k],
                               t.encode_s + t.decode_s + self.beta[k + 1])
        self._spans: dict[tuple[int, int], tuple[float, ...]] = {}

    @classmethod
    def of(cls, tasks: Sequence[TensorTask], backward_end_s: float, optimizer_s: float = 0.0) -> Swaps | None:
        """The plan's Swaps, or None where it does not qualify (side-stream work, ready times out of order)."""
        ordered = all(a.ready_s <= b.ready_s for a, b in zip(tasks, tasks[1:], strict=False))
        return cls(tasks, backward_end_s, optimizer_s) if ordered and all(map(_on_compute, tasks)) else None

    def time(self, changes: dict[int, TensorTask]) -> float:
        """Iteration time with ``tasks[i]`` replaced by ``changes[i]`` (same ready time, compute stream)."""
        at = sorted(changes)
        state = self.states[at[0]]
        for k, i in enumerate(at):
            task = changes[i]
            if task.ready_s != self.tasks[i].ready_s or not _on_compute(task):
                raise ValueError(f"Swaps: {task.name} must keep ready time {self.tasks[i].ready_s} "
                                 "and run on the compute stream")
            state = _compute_step(state, task)
            if k + 1 < len(at) and at[k + 1] > i + 1:
                state = _apply_span(self._span(i + 1, at[k + 1]), state)
        comm_free, stolen, last_decode = state
        hi = at[-1]
        return max(last_decode, comm_free + self.alpha[hi + 1], stolen + self.beta[hi + 1]) + self.optimizer_s

    def _span(self, a: int, b: int) -> tuple[float, ...]:
        """Tasks a..b-1 as one map of the state: from (C, S, M) to
        (max(C + p, S + q), S + s, max(M, C + u, S + v)); returned as (p, q, s, u, v)."""
        found = self._spans.get((a, b))
        if found is None:
            p, q, s, u, v = 0.0, -math.inf, 0.0, -math.inf, -math.inf
            for task in self.tasks[a:b]:
                p, q = p + task.comm_s, max(q + task.comm_s,
                                            s + task.ready_s + task.encode_s + task.lag_s + task.comm_s)
                u, v = max(u, p + task.decode_s), max(v, q + task.decode_s)
                s += task.encode_s + task.decode_s
            found = self._spans[a, b] = (p, q, s, u, v)
        return found


def _apply_span(span: tuple[float, ...], state: tuple[float, float, float]) -> tuple[float, float, float]:
    p, q, s, u, v = span
    comm_free, stolen, last_decode = state
    return max(comm_free + p, stolen + q), stolen + s, max(last_decode, comm_free + u, stolen + v)


def _on_compute(task: TensorTask) -> bool:
    return task.encode_on_compute or task.encode_s == task.decode_s == 0


def _message_start(state: tuple[float, float, float], task: TensorTask) -> float:
    """When a compute-stream task's message starts: its encode starts when it is ready."""
    comm_free, stolen, _ = state
    return max(task.ready_s + stolen + task.encode_s + task.lag_s, comm_free)


def _compute_step(state: tuple[float, float, float], task: TensorTask) -> tuple[float, float, float]:
    """The module doc's recursion for one compute-stream task."""
    _, stolen, last_decode = state
    comm_end = _message_start(state, task) + task.comm_s
    return comm_end, stolen + task.encode_s + task.decode_s, max(last_decode, comm_end + task.decode_s)
