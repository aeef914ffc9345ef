"""ddlscale/conf/experiment/: each paper's regime is one config that composes, passes the checks a run makes
before any worker starts, and says in its header what of the paper it keeps and what it does not."""

import pytest
from hydra import compose, initialize_config_dir

from ddlscale.paths import CONF_DIR
from ddlscale.trainer import ConfigError, check_config

# the papers' regimes (overhead.yaml is a benchmark's)
REGIMES = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*_paper*.yaml"))


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_the_three_papers_each_have_a_regime():
    assert {"zen_paper", "zen_paper_deepfm", "espresso_paper", "gemini_paper"} <= set(REGIMES)


@pytest.mark.parametrize("name", REGIMES)
def test_a_regime_composes_passes_the_checks_and_says_what_it_keeps(name):
    cfg = _compose(f"experiment={name}")
    check_config(cfg)
    assert cfg.cluster.kind == "emulated" and cfg.cluster.nodes >= 4
    header = (CONF_DIR / "experiment" / f"{name}.yaml").read_text().split("defaults:")[0]
    assert "Kept from the paper" in header and "Not kept" in header, name
    assert f"experiment={name}" in header  # the one command that runs it


def test_the_lstm_regime_with_deepfm_swapped_in_is_refused_naming_the_key():
    # why the CTR model has a file of its own: zen_paper's model keys are the LSTM's
    with pytest.raises(ConfigError, match="model.seq_len"):
        check_config(_compose("experiment=zen_paper", "model=deepfm_large"))


def test_a_run_in_which_no_rank_would_get_a_whole_batch_is_refused_naming_both_keys():
    # each of 16 ranks would get 4,096 samples against a batch of 8,192: the fit would take no step
    with pytest.raises(ConfigError, match=r"model.num_samples=65536 .* 16 ranks 4096 samples.*model.batch_size=8192"):
        check_config(_compose("experiment=zen_paper_deepfm", "model.num_samples=65536"))
    check_config(_compose("experiment=zen_paper_deepfm", "model.num_samples=131072"))  # one batch each
