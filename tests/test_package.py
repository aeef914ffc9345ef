"""ddlscale as an installed package: its configs and kernel sources live inside it, and a wheel installed
into a fresh environment (not editable, no checkout on the path) trains from any directory through
``ddlscale-train`` and ``python -m ddlscale``."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

import ddlscale
from ddlscale import paths
from ddlscale.compress.registry import COMPRESSORS
from ddlscale.sync.sparse import native

ROOT = Path(__file__).resolve().parents[1]


def test_configs_and_kernel_sources_are_found_inside_the_package():
    package = Path(ddlscale.__file__).resolve().parent
    assert paths.CONF_DIR == package / "conf" and (paths.CONF_DIR / "config.yaml").is_file()
    assert paths.CSRC_DIR == package / "csrc"
    assert all((paths.CSRC_DIR / source).is_file() for source in native.SOURCES["cpu"])
    # The compressor registry reads its names from the package's config group.
    assert {"dgc", "topk", "efsignsgd"} <= set(COMPRESSORS)
    assert not (ROOT / "conf").exists() and not (ROOT / "csrc").exists(), "a second copy outside the package"


def test_hydra_composes_from_the_package_search_path_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of the checkout here
    with initialize_config_module(config_module="ddlscale.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["sync=zen", "experiment=zen_paper"])
    assert cfg.sync._target_.endswith("ZenSync") and cfg.cluster.nodes == 16


def _build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, timeout=600)
    return next(out.glob("ddlscale-*.whl"))


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_trains_from_an_empty_directory(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddlscale/conf/config.yaml" in names and "ddlscale/conf/sync/zen.yaml" in names
    assert "ddlscale/csrc/zen_cpu.cpp" in names and "ddlscale/csrc/zen_hash.h" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # The CPU build of torch first: the wheel's bare `torch` requirement would otherwise pull a CUDA build.
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=1200)
    subprocess.run([*pip, str(wheel)], check=True, timeout=1200)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    for command in (["ddlscale-train", "trainer.max_steps=5", "trainer.enable_progress_bar=false"],
                    ["python", "-m", "ddlscale", "sync=zen", "trainer.max_steps=5", "trainer.enable_progress_bar=false"]):
        done = subprocess.run(command, cwd=empty, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "finished 5 steps" in done.stdout, done.stdout[-3000:]
    summaries = [json.loads(p.read_text()) for p in empty.glob("outputs/*/*/summary.json")]
    assert sorted(s["sync"] for s in summaries) == ["dense", "zen"]
    assert all(s["status"] == "finished" and s["steps"] == 5 for s in summaries)
    # It ran the installed copy, not this checkout.
    where = subprocess.run(["python", "-c", "import ddlscale; print(ddlscale.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert str(venv) in where and str(ROOT) not in where
