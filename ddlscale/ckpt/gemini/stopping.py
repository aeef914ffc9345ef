"""What a stop of a Gemini job waits for: the drain's deadline, and the mark of its end.

On a stop the agents keep serving their replicas until the drain of the newest committed version has read
them (:mod:`ddlscale.ckpt.gemini.drain`; the agents' side is :meth:`ddlscale.ckpt.gemini.agent.Agent.wind_down`).
How long the drain may take follows the version's size and the rate its bytes move at (:func:`deadline_for`);
whoever drained says it is over in a signed key of the job's incarnation (:func:`mark_drained`), so no
earlier launch's mark counts. Apart from the drain itself, whose writer imports the persistent tier: an
agent reads this on every stop and should not pay for that.
"""

from __future__ import annotations

from ddlscale.ckpt.gemini.kvstore import JobStore

FLOOR_S = 10.0  # what any drain takes whatever the size: connections, the manifest, DCP's plan, the commit
SLACK = 2.0  # on top of the bytes at the rate: decoding, hashing, a link shared with what is still running
DISK_RATE_BPS = 1e9  # a local persistent directory without ckpt.persist_bandwidth: as slow as a plain disk
# Host seconds between a stop signal and the drain's start: the launcher stops the workers first (their
# grace, stop.GRACE_S) and brings back a store the signal stopped. What the agents wait beyond the drain.
STOP_MARGIN_S = 20.0
POLL_S = 0.2  # how often an agent waiting for the drain looks for its end


def deadline_for(nbytes: int, rate_bps: float | None = None) -> float:
    """Seconds (emulated, :mod:`ddlscale.clock`) a drain of a version of ``nbytes`` may take when its bytes
    move at ``rate_bps`` bits/s, the slowest of the path from the holders to the persistent tier (default
    :data:`DISK_RATE_BPS`): a 1.2 TB version at 20 Gbit/s gets about 16 minutes, 10 MB a few seconds over
    :data:`FLOOR_S`."""
    return FLOOR_S + SLACK * nbytes * 8 / (rate_bps or DISK_RATE_BPS)


def series_rate(*rates_bps: float | None) -> float | None:
    """The rate of links crossed one after the other (each replica fetched, then written): 1 / sum(1 / r);
    links not given are not counted, None when none is."""
    given = [r for r in rates_bps if r]
    if len(given) <= 1:
        return given[0] if given else None
    return 1 / sum(1 / r for r in given)


def _drained_key(store: JobStore) -> str:
    return f"{store.keys.prefix}/drained"


def mark_drained(store: JobStore) -> None:
    """The drain is over, whatever it wrote: the agents waiting for it may go."""
    store.set(_drained_key(store), {"incarnation": int(store.get(store.keys.incarnation, 0))})


def was_drained(store: JobStore, incarnation: int) -> bool:
    """Whether a drain of incarnation ``incarnation`` (or a later one) is over."""
    value = store.get(_drained_key(store))
    return isinstance(value, dict) and int(value.get("incarnation", -1)) >= incarnation
