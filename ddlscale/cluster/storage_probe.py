"""How fast the storage machine takes writes: every machine writes through the real client at once.

    python -m ddlscale.cluster storage-probe --nodes 8 --storage-bandwidth 2gbit --dilation 4

Each machine runs one writer (a process on that machine, in its CPU cap, told the cluster's k) that
writes its share of ``seconds`` worth of the storage link's traffic into one object, through fsspec's
WebDAV client exactly as the persistent tier writes a DCP file (``fs.open(path, "wb")``). They start
together; the aggregate rate is every byte written over the span from the first start to the last
PUT answered, in emulated time (wall / k). The configured bandwidth counts Ethernet frames, so TCP's
payload can reach 1448/1514 of it (:data:`~ddlscale.cluster.emulated.TCP_PAYLOAD_FRACTION`); both
ratios are reported. Then every object is read back and compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION, EmulatedCluster
from ddlscale.cluster.storage_client import PutStream, StorageEndpoint
from ddlscale.units import parse_bandwidth

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the writers import this same ddlscale
START_LEAD_S = 2.0  # wall seconds between launching the writers and their common start


@dataclass(frozen=True)
class ProbeResult:
    nodes: int
    setting_bps: float
    dilation: float
    bytes: int
    seconds: float  # emulated: first start to last PUT answered

    @property
    def rate_bps(self) -> float:
        return self.bytes * 8 / self.seconds

    def describe(self) -> str:
        return (f"{self.nodes} machines writing at once through WebDAV, k = {self.dilation:g}: "
                f"{self.bytes / 2**20:.0f} MiB in {self.seconds:.2f} s = {self.rate_bps / 1e6:.1f} Mbit/s aggregate, "
                f"{self.rate_bps / self.setting_bps:.3f} of the setting ({self.setting_bps / 1e6:g} Mbit/s), "
                f"{self.rate_bps / (self.setting_bps * TCP_PAYLOAD_FRACTION):.3f} of its TCP payload rate")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "setting_bps": self.setting_bps, "dilation": self.dilation, "bytes": self.bytes,
                "seconds": self.seconds, "rate_bps": self.rate_bps, "ratio": self.rate_bps / self.setting_bps}


def probe(nodes: int, storage_bandwidth: str, bandwidth: str = "10gbit", dilation: float = 1.0,
          seconds: float = 4.0) -> ProbeResult:
    """Write ``seconds`` of the storage link's traffic from ``nodes`` machines at once; the measured rate.

    The machines' own NICs (``bandwidth``) default to faster than their share of the storage link, so
    that the shared link is what is measured (as in the regime it stands for: 16 machines' NICs far
    faster than 20 Gbit/s / 16)."""
    setting = parse_bandwidth(storage_bandwidth)
    share = int(seconds * setting * TCP_PAYLOAD_FRACTION / 8 / nodes)
    with tempfile.TemporaryDirectory(prefix="ddlscale-storage-probe-") as root, \
            EmulatedCluster(nodes, bandwidth, dilation=dilation, storage_bandwidth=storage_bandwidth,
                            storage_root=root) as cluster:
        start_at = time.time() + START_LEAD_S * dilation
        env = cluster.storage_endpoint.env()
        writers = [cluster.popen(i, [sys.executable, "-m", __name__, "--write", str(share), "--start-at", str(start_at),
                                     "--object", f"probe/m{i}"], env=env, stdout=subprocess.PIPE, text=True,
                                    cwd=PACKAGE_PARENT)
                   for i in range(nodes)]
        reports = []
        for i, writer in enumerate(writers):
            out, _ = writer.communicate(timeout=600 * dilation)
            if writer.returncode:
                raise RuntimeError(f"storage probe: the writer on machine {i} failed (exit {writer.returncode})")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        for i in range(nodes):  # what the store holds is what was sent
            stored = (cluster.storage.root / "probe" / f"m{i}").read_bytes()
            if stored != _pattern(share, f"probe/m{i}"):
                raise RuntimeError(f"storage probe: machine {i}'s object came back different")
    span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return ProbeResult(nodes, setting, dilation, share * nodes, span / dilation)


def _pattern(size: int, name: str) -> bytes:
    """Bytes no layer can compress or deduplicate, different per object."""
    seed = name.encode().ljust(32, b".")[:32]
    block = (seed * (65536 // 32))
    return bytes(b ^ (i & 0xFF) for i, b in enumerate(block[:4096])) * (size // 4096) + block[: size % 4096]


def _write(size: int, start_at: float, name: str) -> None:
    """One machine's writer: the bytes ready first, then one object written at ``start_at`` (wall)."""
    fs = StorageEndpoint.from_env().filesystem()
    data = _pattern(size, name)
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    with PutStream(fs, name) as stream:  # the tier's path: DCP's files go out so (RemoteStore.dcp_writer)
        stream.write(data)
    print(json.dumps({"start": start, "end": time.time()}), flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--write", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--object", required=True)
    args = parser.parse_args()
    _write(args.write, args.start_at, args.object)
