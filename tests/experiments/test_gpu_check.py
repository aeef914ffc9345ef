"""The prepared GPU check: its sync sections run on CPU so they stay runnable for a GPU day, and
without a GPU the script says so and exits cleanly."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddlscale.cluster import run_workers
from experiments.gpu_check import _compress_on, _sparse_on, main


@pytest.mark.multiprocess
def test_the_compressed_sync_check_passes_on_cpu():
    for result in run_workers(_compress_on, 2, "cpu"):
        assert result and all(v is True for v in result.values()), result


@pytest.mark.multiprocess
def test_the_sparse_sync_check_passes_on_cpu():
    for result in run_workers(_sparse_on, 2, "cpu"):
        assert result and all(v is True for v in result.values()), result


def test_without_a_gpu_it_says_so_and_checks_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["C", f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "nothing was checked" in out and ".[gpu]" in out
    assert list(tmp_path.iterdir()) == []  # no results.md claims a comparison that never ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_the_script_exits_cleanly_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.gpu_check", f"--out={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "no CUDA device" in done.stdout and list(tmp_path.iterdir()) == []
