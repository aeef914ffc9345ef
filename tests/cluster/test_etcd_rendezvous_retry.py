"""torchrun's etcd rendezvous (``--rdzv-backend=ddlscale-etcd``) rides out an etcd leader election."""

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from ddlscale.cluster.etcd_rendezvous import _retrying


def test_a_request_is_retried_while_etcd_has_no_leader():
    answers = [RendezvousConnectionError("no leader"), RendezvousConnectionError("no leader"), "state"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert _retrying(call, window_s=1.0, pause_s=0.01) == "state" and answers == []


def _always(error, calls):
    def call():
        calls.append(1)
        raise error
    return call


def test_a_request_still_failing_after_the_window_fails():
    calls = []
    with pytest.raises(RendezvousConnectionError):
        _retrying(_always(RendezvousConnectionError("etcd gone"), calls), window_s=0.05, pause_s=0.01)
    assert 2 <= len(calls) <= 10


def test_other_errors_are_not_retried():
    calls = []
    with pytest.raises(ValueError):
        _retrying(_always(ValueError("a bug, not an election"), calls), window_s=1.0, pause_s=0.01)
    assert calls == [1]
