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


pytest_plugins = ["gemini_job"]  # the job, agent fixtures of the Gemini tests
