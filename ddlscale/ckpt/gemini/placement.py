"""Where the m replicas of each machine's checkpoint live, and how likely k failures are survivable.

Gemini keeps every machine's checkpoint shard on m machines (itself plus m - 1 peers). Training can
recover from a set of simultaneous machine failures only if every shard still has a live holder.

Placements (all built from one shape, a *ring component*: a cycle of g machines in which the shard of
the machine at position p is held by positions p, p+1, ..., p+m-1 mod g):

* ``group``: consecutive groups of m machines; each member holds the whole group's shards (a ring
  component with g = m). Optimal when m divides N; refused otherwise.
* ``mixed``: the paper's algorithm for any N: groups of m, except that when m does not divide N the
  last group takes m + (N mod m) machines and uses ring placement inside. Equals ``group`` when m | N.
* ``ring``: one cycle over all N machines, each sending to the next m - 1 (the comparison point).

Probabilities are exact rational numbers (:class:`fractions.Fraction`): either by enumerating all
C(N, k) failure sets or by counting them combinatorially, component by component.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from fractions import Fraction

KINDS = ("mixed", "group", "ring")
# Enumerate failure sets up to this many; count combinatorially beyond.
ENUMERATION_LIMIT = 200_000


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class PlacementPlan:
    """Replica placement of ``replicas`` (m) copies of each shard over ``machines`` (N) machines.

    Machine i's checkpoint is shard i. ``components`` are the disjoint rings of machines; a shard's
    holders never leave its component, which is what makes the exact count factorize.
    """

    machines: int
    replicas: int
    kind: str = "mixed"

    def __post_init__(self) -> None:
        n = _check_int("N (machines)", self.machines, 1)
        m = _check_int("m (replicas)", self.replicas, 1)
        if m > n:
            raise ValueError(f"m (replicas) must be <= N (machines) = {n}, got m={m}")
        if self.kind not in KINDS:
            raise ValueError(f"placement kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "group" and n % m:
            raise ValueError(
                f"group placement needs m (replicas) to divide N (machines): N={n}, m={m}; use kind='mixed'"
            )

    # -- layout --------------------------------------------------------------------------------
    @property
    def components(self) -> tuple[tuple[int, ...], ...]:
        """The disjoint machine rings, in machine order."""
        n, m = self.machines, self.replicas
        if self.kind == "ring":
            return (tuple(range(n)),)
        groups = n // m
        bounds = [i * m for i in range(groups)] + [n]  # the last group absorbs N mod m machines
        return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(groups))

    def _component_of(self, machine: int) -> tuple[int, ...]:
        self._check_machine("machine", machine)
        if self.kind == "ring":
            return tuple(range(self.machines))
        n, m = self.machines, self.replicas
        groups = n // m
        index = min(machine // m, groups - 1)
        return self.components[index]

    def _check_machine(self, name: str, value: int) -> None:
        if not isinstance(value, int) or not 0 <= value < self.machines:
            raise ValueError(f"{name} must be in 0..{self.machines - 1}, got {value!r}")

    def holders_of(self, shard: int) -> tuple[int, ...]:
        """Machines that keep a replica of ``shard`` (machine ``shard``'s checkpoint), owner first."""
        self._check_machine("shard", shard)
        ring = self._component_of(shard)
        start = ring.index(shard)
        return tuple(ring[(start + i) % len(ring)] for i in range(self.replicas))

    def verified(self, acknowledged: list[list[int] | None], machine_of: list[int]) -> int:
        """Replicas acknowledged as verified, over ranks: ``acknowledged[r]`` are the holders that checked
        rank r's replica (None: no trustworthy acknowledgement); only holders this plan names for the
        rank's machine count, each once. A version is complete at ``len(machine_of) * replicas``."""
        return sum(len(set(holders or ()) & set(self.holders_of(machine_of[rank])))
                   for rank, holders in enumerate(acknowledged[:len(machine_of)]))

    def peers_of(self, machine: int) -> tuple[int, ...]:
        """Machines ``machine`` sends its checkpoint to."""
        return self.holders_of(machine)[1:]

    def replicas_of(self, machine: int) -> tuple[int, ...]:
        """Shards whose replicas ``machine`` keeps, its own first."""
        self._check_machine("machine", machine)
        ring = self._component_of(machine)
        start = ring.index(machine)
        return tuple(ring[(start - i) % len(ring)] for i in range(self.replicas))

    # -- failures ------------------------------------------------------------------------------
    def lost_shards(self, failed: set[int] | frozenset[int]) -> list[int]:
        """Shards none of whose holders survive ``failed``."""
        return [s for s in range(self.machines) if all(h in failed for h in self.holders_of(s))]

    def recovery_source(self, shard: int, failed: set[int] | frozenset[int]) -> int | None:
        """A live holder of ``shard`` (its owner when alive), or None when the shard is lost."""
        return next((h for h in self.holders_of(shard) if h not in failed), None)

    def describe(self) -> str:
        comps = self.components
        sizes = sorted({len(c) for c in comps})
        if self.kind == "ring":
            return f"ring over {self.machines} machines, each shard on {self.replicas} consecutive machines"
        ring_note = "" if sizes == [self.replicas] else f"; last group of {len(comps[-1])} uses ring placement"
        return f"{self.kind}: {len(comps)} group(s) of {self.replicas}{ring_note}"


# -- exact probabilities ---------------------------------------------------------------------------


def _check_k(plan: PlacementPlan, k: object) -> int:
    k = _check_int("k (simultaneous failures)", k, 0)
    if k > plan.machines:
        raise ValueError(f"k (simultaneous failures) must be <= N (machines) = {plan.machines}, got k={k}")
    return k


def _linear_no_run(length: int, ones: int, m: int) -> int:
    """Binary strings of ``length`` with ``ones`` ones and no run of m ones."""
    if ones < 0 or ones > length:
        return 0
    zeros = length - ones
    slots = zeros + 1  # ones sit in the gaps around the zeros, fewer than m per gap
    total = 0
    for i in range(min(slots, ones // m) + 1):
        total += (-1) ** i * math.comb(slots, i) * math.comb(ones - i * m + zeros, zeros)
    return total


def _cyclic_no_run(size: int, ones: int, m: int) -> int:
    """j-subsets of a ``size``-cycle that contain no m cyclically consecutive positions (m <= size).

    A subset with at least one gap reads as 1^a 0 X 0 1^b (or 1^a 0 1^b with a single gap): the run
    that wraps around has length a + b < m and the middle X is an unconstrained linear string.
    """
    if ones >= size:
        return 0
    total = 0
    for wrap in range(min(m - 1, ones) + 1):  # wrap = a + b, reached by wrap + 1 splits (a, b)
        middle = size - wrap - 2
        if middle >= 0:
            total += (wrap + 1) * _linear_no_run(middle, ones - wrap, m)
        elif ones == wrap:  # exactly one gap: 1^a 0 1^b with a + b = size - 1
            total += wrap + 1
    return total


def surviving_sets(plan: PlacementPlan, k: int) -> int:
    """Number of k-sets of failed machines after which every shard has a live holder (exact count).

    Components fail independently, so the count is the k-th coefficient of the product of each
    component's polynomial sum_j (good j-subsets of that component) x^j.
    """
    k = _check_k(plan, k)
    poly = [1]  # coefficients up to x^k: higher ones never matter
    for ring in plan.components:
        part = [_cyclic_no_run(len(ring), j, plan.replicas) for j in range(min(len(ring), k) + 1)]
        product = [0] * min(len(poly) + len(part) - 1, k + 1)
        for i, a in enumerate(poly):
            for j, b in enumerate(part[: len(product) - i]):
                product[i + j] += a * b
        poly = product
    return poly[k] if k < len(poly) else 0


def enumerate_surviving_sets(plan: PlacementPlan, k: int) -> int:
    """The same count by checking every k-set of failed machines (brute force)."""
    k = _check_k(plan, k)
    masks = [sum(1 << h for h in plan.holders_of(s)) for s in range(plan.machines)]
    good = 0
    for failed in itertools.combinations(range(plan.machines), k):
        dead = sum(1 << f for f in failed)
        # A shard can only be lost if its owner is among the failed (the owner is a holder).
        good += all(masks[f] & ~dead for f in failed)
    return good


def recovery_probability(plan: PlacementPlan, k: int, method: str = "auto") -> Fraction:
    """Exact Pr(every shard survives) when k machines, chosen uniformly, fail at once.

    ``method``: ``"count"`` (combinatorial), ``"enumerate"`` (brute force), or ``"auto"`` (enumerate
    while C(N, k) <= ENUMERATION_LIMIT). Both are exact; tests check they agree.
    """
    k = _check_k(plan, k)
    if method not in ("auto", "count", "enumerate"):
        raise ValueError(f"method must be auto, count or enumerate, got {method!r}")
    total = math.comb(plan.machines, k)
    if method == "enumerate" or (method == "auto" and total <= ENUMERATION_LIMIT):
        return Fraction(enumerate_surviving_sets(plan, k), total)
    return Fraction(surviving_sets(plan, k), total)


def paper_bound(machines: int, replicas: int, k: int) -> Fraction:
    """Gemini's lower bound for group placement with m | N: 1 - N C(N-m, k-m) / (m C(N, k)).

    A union bound over the N/m groups, each lost with probability C(N-m, k-m)/C(N, k); exact for
    m <= k < 2m, where no two groups can be lost together. 1 for k < m.
    """
    plan = PlacementPlan(machines, replicas, "mixed")  # validates N and m
    k = _check_k(plan, k)
    n, m = machines, replicas
    if k < m:
        return Fraction(1)
    return 1 - Fraction(n * math.comb(n - m, k - m), m * math.comb(n, k))


def monte_carlo(plan: PlacementPlan, k: int, trials: int = 100_000, seed: int = 0) -> tuple[float, float]:
    """Sampled Pr(recover) and its standard error, from ``trials`` uniform k-sets of failures."""
    k = _check_k(plan, k)
    trials = _check_int("trials", trials, 1)
    rng = random.Random(seed)
    masks = [sum(1 << h for h in plan.holders_of(s)) for s in range(plan.machines)]
    machines = range(plan.machines)
    good = 0
    for _ in range(trials):
        failed = rng.sample(machines, k)
        dead = sum(1 << f for f in failed)
        good += all(masks[f] & ~dead for f in failed)
    p = good / trials
    return p, math.sqrt(p * (1 - p) / trials)
