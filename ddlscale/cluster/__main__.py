"""`python -m ddlscale.cluster up|run|down|list`: manage emulated clusters by hand.

    python -m ddlscale.cluster up --nodes 4 --bandwidth 1gbit       # prints the cluster's name
    python -m ddlscale.cluster run --name ddl1a2b3c --machine 1 -- ip addr
    python -m ddlscale.cluster down --name ddl1a2b3c
    python -m ddlscale.cluster down --all     # every cluster whose owning process is gone
    python -m ddlscale.cluster dilation --nodes 8 --bandwidth 1gbit --fresh   # probe cluster.dilation=auto's k
    python -m ddlscale.cluster storage-probe --nodes 8 --storage-bandwidth 2gbit --dilation 4  # the storage link's write rate
A cluster made with `up` stays until `down --name`; train.py's `cluster=emulated` makes and removes
its own. `down --all` never touches a cluster whose owner still runs (someone else's run on this
host), one kept by `up`, nor namespaces that recorded no owner: remove those by name.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ddlscale.cluster import dilation, storage
from ddlscale.cluster.cpucap import find_controller, remove_groups
from ddlscale.cluster.emulated import (
    PREFIX,
    EmulatedCluster,
    forget_owner,
    list_namespaces,
    owner_alive,
    owner_record,
    owners_dir,
    remove_namespaces,
)
from ddlscale.cluster.stop import start_time
from ddlscale.units import parse_bandwidth, parse_time

PROBE = f"{PREFIX}probe"  # unavailable_reason()'s short-lived namespace, named after its pid


def _clusters() -> dict[str, int]:
    """Cluster name -> machine count, read from the namespaces that exist now."""
    found: dict[str, int] = {}
    for ns in list_namespaces(PREFIX):
        name, _, role = ns.partition("-")
        found.setdefault(name, 0)
        found[name] += role.startswith("m")
    return found


def ownership(name: str) -> tuple[bool, str]:
    """(whether ``down --all`` may remove cluster ``name``, who owns it)."""
    if name.startswith(PROBE):
        pid = name[len(PROBE):]
        alive = pid.isdigit() and start_time(int(pid)) is not None
        return not alive, f"probe of process {pid} ({'running' if alive else 'gone'})"
    record = owner_record(name)
    if record is None:
        return False, "no owner recorded (made elsewhere): remove it with down --name"
    if record.get("kept"):
        return False, f"kept by `up` on {record.get('created')}: remove it with down --name"
    if owner_alive(record):
        return False, f"owned by running process {record['owner_pid']}"
    return True, f"owner process {record.get('owner_pid')} gone"


def _down_all() -> None:
    removed = 0
    for name in sorted(_clusters()):
        removable, owner = ownership(name)
        if removable:
            remove_namespaces(list_namespaces(name if name.startswith(PROBE) else f"{name}-"))
            remove_groups(find_controller(), name)
            storage.forget_config(name)
            forget_owner(name)
            removed += 1
        print(f"{name}: {'removed' if removable else 'left up'} ({owner})")
    live = set(_clusters())
    for record in owners_dir().glob(f"{PREFIX}*.json"):  # records of clusters already gone
        if record.stem not in live:
            record.unlink(missing_ok=True)
    print(f"removed {removed} clusters")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create an emulated cluster and leave it up")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--bandwidth", default="1gbit")
    up.add_argument("--latency", default="0ms")
    up.add_argument("--name")
    run = sub.add_parser("run", help="run a command inside one machine (or all) of a cluster")
    run.add_argument("--name", required=True)
    run.add_argument("--machine", default="all", help="machine index or 'all'")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="remove a cluster (kills everything inside it)")
    down.add_argument("--name")
    down.add_argument("--all", action="store_true", help="remove every cluster whose owning process is gone")
    sub.add_parser("list", help="list emulated clusters")
    probe = sub.add_parser("dilation", help="the k cluster.dilation=auto picks for a cluster shape (probes if not cached)")
    probe.add_argument("--nodes", type=int, required=True)
    probe.add_argument("--ranks", type=int, default=1, help="ranks per machine (trainer.devices)")
    probe.add_argument("--bandwidth", default="1gbit")
    probe.add_argument("--latency", default="0ms")
    probe.add_argument("--fresh", action="store_true", help="probe again instead of reading the cache")
    writes = sub.add_parser("storage-probe", help="every machine writes to the storage machine at once: the rate")
    writes.add_argument("--nodes", type=int, required=True)
    writes.add_argument("--storage-bandwidth", required=True, help="the storage machine's NIC, e.g. 2gbit")
    writes.add_argument("--bandwidth", default="10gbit", help="each machine's NIC (default: faster than its share)")
    writes.add_argument("--dilation", type=float, default=1.0, help="time dilation k (a number >= 1)")
    writes.add_argument("--seconds", type=float, default=4.0, help="the storage link's seconds of traffic written")
    writes.add_argument("--reps", type=int, default=1)
    args = parser.parse_args(argv)

    if args.command == "up":
        cluster = EmulatedCluster(args.nodes, args.bandwidth, args.latency, name=args.name, keep=True).up()
        addresses = ", ".join(cluster.address(i) for i in range(cluster.nodes))
        print(f"{cluster.name}: {cluster.nodes} machines at {addresses}, {args.bandwidth} NICs")
        return 0
    if args.command == "dilation":
        choice = dilation.choose(dilation.AUTO, args.nodes, args.ranks, parse_bandwidth(args.bandwidth),
                                 parse_time(args.latency), fresh=args.fresh)
        print(choice.describe())
        return 0
    if args.command == "storage-probe":
        from ddlscale.cluster.storage_probe import probe as storage_probe

        for _ in range(args.reps):
            print(storage_probe(args.nodes, args.storage_bandwidth, args.bandwidth, args.dilation, args.seconds).describe(),
                  flush=True)
        return 0
    clusters = _clusters()
    if args.command == "list":
        for name, machines in sorted(clusters.items()):
            print(f"{name}: {machines} machines, {ownership(name)[1]}")
        return 0
    if args.command == "down":
        if args.all == bool(args.name):
            parser.error("down needs --name NAME or --all")
        if args.all:
            _down_all()
            return 0
        names = list_namespaces(f"{args.name}-")
        remove_namespaces(names)
        remove_groups(find_controller(), args.name)
        storage.forget_config(args.name)
        forget_owner(args.name)
        print(f"removed {len(names)} namespaces")
        return 0
    if args.name not in clusters:
        parser.error(f"no emulated cluster named {args.name!r} (have: {', '.join(clusters) or 'none'})")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    machines = range(clusters[args.name]) if args.machine == "all" else [int(args.machine)]
    codes = [subprocess.call(["ip", "netns", "exec", f"{args.name}-m{i}", *cmd]) for i in machines]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
