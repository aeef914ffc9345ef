"""ddlscale.clock: a dilated process's timers run k times longer, its own interpreter's included."""

import os
import subprocess
import sys

import pytest

from ddlscale import clock


@pytest.mark.slow  # the default run's time: make test-slow runs it
def test_a_dilated_process_stretches_the_gil_switch_interval_by_k():
    code = "import sys; from ddlscale import clock; clock.dilation(); print(sys.getswitchinterval())"
    for k, want in (("4", clock.SWITCH_INTERVAL_S * 4), ("", clock.SWITCH_INTERVAL_S)):
        shown = subprocess.run([sys.executable, "-c", code], env={**os.environ, clock.ENV: k}, capture_output=True,
                               text=True, check=True)
        assert abs(float(shown.stdout) - want) < 1e-9
