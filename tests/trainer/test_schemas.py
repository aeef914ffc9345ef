"""Every config group's schema: registered in Hydra's ConfigStore, agreeing with the option files,
and refusing a bad value naming its key before anything is built."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ddlscale.paths import CONF_DIR
from ddlscale.schema import Schema
from ddlscale.sync.sparse import ZenSync
from ddlscale.trainer import ConfigError, app, check_config, schemas


class ZenWithAKnob(ZenSync):
    """A user's subclass with a key of its own: the schema checks Zen's keys and leaves this one to it."""

    def __init__(self, knob: int = 0, **kwargs):
        if knob < 0:
            raise ValueError(f"sync.knob must be >= 0, got {knob}")
        super().__init__(**kwargs)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _stored(group: str) -> set[str]:
    return {name.removesuffix(".yaml") for name in ConfigStore.instance().list(f"schema/{group}")}


def test_every_option_of_every_group_has_a_registered_schema():
    schemas.register()
    for group in (*schemas.GROUPS, "cluster"):
        options = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
        with_target = {o for o in options if group == "cluster" or OmegaConf.load(CONF_DIR / group / f"{o}.yaml").get("_target_")}
        assert with_target <= _stored(group), group
    assert _stored("trainer") == {"default"} and "run.yaml" in ConfigStore.instance().list("schema")


DECLARED = [("sync", p.stem) for p in sorted((CONF_DIR / "sync").glob("*.yaml"))] + [("ckpt", "gemini"), ("ckpt", "disk"), ("strategy", "ddlscale")]


@pytest.mark.parametrize("group,option", DECLARED, ids=[f"{g}={o}" for g, o in DECLARED])
def test_a_declared_schema_has_every_key_its_file_sets(group, option):
    cfg = _cfg(f"{group}={option}")
    schema = schemas._target_class(cfg[group]).schema
    assert issubclass(schema, Schema)
    from_elsewhere = {"_target_", "compressor"}  # the class, and the object built from compressor=
    assert set(cfg[group]) - from_elsewhere <= {f.name for f in dataclasses.fields(schema)}, option


REFUSED = [  # overrides, the key named, the cause
    (["sync=zen", "sync.route=sideways"], "sync.route", "auto, sparse"),
    (["sync=zen", "sync.scheme=xy"], "sync.scheme", "auto, bp, hc"),
    (["sync=sparcml", "sync.dense_threshold=2"], "sync.dense_threshold", "(0, 1]"),
    (["sync=omnireduce", "sync.block_size=0"], "sync.block_size", ">= 1"),
    (["sync=espresso", "compressor=topk", "sync.offload=maybe"], "sync.offload", "true or false"),
    (["sync=cupcake", "compressor=topk", "sync.settle_steps=0"], "sync.settle_steps", ">= 1"),
    (["sync=compress", "compressor=topk", "sync.fusion=all"], "sync.fusion", "tensor, bucket"),
    (["sync=dense", "sync.first_bucket_mb=0"], "sync.first_bucket_mb", "> 0"),
    (["cluster=emulated", "cluster.port=70000"], "cluster.port", "[1, 65535]"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", ">= 1"),
    (["ckpt=gemini", "ckpt.subbuffers=0"], "ckpt.subbuffers", ">= 1"),
    (["ckpt=gemini", "ckpt.resume=latest"], "ckpt.resume", "null, auto"),
    (["ckpt=disk", "ckpt.keep=0"], "ckpt.keep", ">= 1"),
    (["ckpt=disk", "ckpt.bandwidth=fast"], "ckpt.bandwidth", "bad bandwidth 'fast'"),
    (["strategy.start_method=thread"], "strategy.start_method", "spawn, popen, fork, forkserver"),
]


@pytest.mark.parametrize("overrides,key,cause", REFUSED, ids=[" ".join(o) for o, _, _ in REFUSED])
def test_the_schema_refuses_before_anything_is_built(overrides, key, cause, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("built before the schema refused")

    monkeypatch.setattr(app, "_build", no_build)
    with pytest.raises(ConfigError) as refused:
        check_config(_cfg(*overrides))
    message = str(refused.value)
    assert message.startswith(key) and cause in message


def test_a_user_subclass_keeps_its_own_keys_and_zens_checks():
    target = f"{__name__}.ZenWithAKnob"
    check_config(_cfg("sync=zen", f"sync._target_={target}", "+sync.knob=3"))
    with pytest.raises(ConfigError, match=r"^sync\.knob"):
        check_config(_cfg("sync=zen", f"sync._target_={target}", "+sync.knob=-1"))
    with pytest.raises(ConfigError, match=r"^sync\.pull"):
        check_config(_cfg("sync=zen", f"sync._target_={target}", "+sync.knob=3", "sync.pull=zip"))


def test_a_sync_without_a_schema_of_its_own_checks_its_keys_when_built():
    # the example's call without a config file: a GradSync subclass, dense's keys removed
    cfg = _cfg("sync._target_=ddlscale.sync.grad_sync.GradSync", "~sync.bucket_mb", "~sync.first_bucket_mb")
    check_config(cfg)


def test_a_config_of_ones_own_can_extend_a_stored_schema(tmp_path):
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "typed_zen.yaml").write_text("defaults:\n  - /schema/sync/zen@_here_\n  - _self_\n\nscheme: bp\n")
    schemas.register()
    search = f"hydra.searchpath=[file://{tmp_path}]"
    cfg = _cfg(search, "sync=typed_zen")
    assert cfg.sync.scheme == "bp" and cfg.sync.profile_steps == 2 and cfg.sync._target_.endswith("ZenSync")
    check_config(cfg)  # and it builds
    with pytest.raises(Exception, match="sync.profile_steps"):
        _cfg(search, "sync=typed_zen", "sync.profile_steps=many")  # typed: refused as it is composed


def test_derived_schemas_take_a_constructors_keywords():
    from ddlscale.compress import DGC

    fields = {f.name: f.default for f in dataclasses.fields(schemas.derived(DGC))}
    assert fields["ratio"] == 0.01 and "momentum_masking" in fields
