"""A stopped experiment stops its train.py gracefully: SIGTERM, and its output read while it tears down."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for train.py's launcher: on SIGTERM it writes far more than a pipe holds (a teardown that
# prints), then records that it finished; otherwise it waits.
CHILD = r"""
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, frame):
    for _ in range(400):
        print("tearing down " + "x" * 1000, flush=True)
    (out / "clean").write_text("done")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out / "started").write_text("yes")
time.sleep(120)
"""

PARENT = "import sys; from experiments.harness import run_child; run_child([sys.executable, sys.argv[1], sys.argv[2]], 120)"


def test_a_stopped_harness_lets_its_child_tear_down(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(child), str(tmp_path)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode != 0 and "SIGTERM" in err  # the harness stops too, saying why
    assert (tmp_path / "clean").read_text() == "done"  # the child finished its teardown, all of its output read
