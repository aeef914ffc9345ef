"""Shared test set-up."""

import os

import pytest


@pytest.fixture(autouse=True)
def fresh_rendezvous_port():
    """Lightning's spawn launcher leaves MASTER_PORT set in this process; a later test would reuse a
    port the last one's workers may still hold. Give every test a fresh one."""
    saved = os.environ.get("MASTER_PORT")
    yield
    if saved is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = saved


@pytest.fixture(autouse=True, scope="session")
def own_dilation_cache(tmp_path_factory):
    """cluster.dilation=auto's probe results go to a cache of the test session, never the user's."""
    saved = os.environ.get("DDLSCALE_CACHE_DIR")
    os.environ["DDLSCALE_CACHE_DIR"] = str(tmp_path_factory.mktemp("ddlscale-cache"))
    yield
    if saved is None:
        os.environ.pop("DDLSCALE_CACHE_DIR", None)
    else:
        os.environ["DDLSCALE_CACHE_DIR"] = saved


pytest_plugins = ["gemini_job"]  # the job, agent fixtures of the Gemini tests
