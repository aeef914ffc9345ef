"""The security drill counts an attempt as refused only when the agent refused it (issue 44 item 7): run
against a deliberately weakened agent (DATA's bounds check removed) it fails, naming the attempt; against
a dead agent nothing counts as refused."""

import signal
import sys

import pytest

from ddlscale.testing.security_drill import Drill

# The agent with DATA's bounds check taken out: a chunk is received into whatever slice the buffer has.
WEAKENED = """
import sys
from ddlscale.ckpt.gemini.agent import main, server
from ddlscale.ckpt.gemini.protocol import DATA, recv_exactly

def data_unchecked(self, r):
    slot = self.server.agent.replicas.writing(r.owner, r.version, r.incarnation)
    recv_exactly(r.sock, memoryview(slot.buf)[r.a:r.a + r.b])

server.ReplicaHandler.HANDLERS[DATA] = data_unchecked
main(sys.argv[1:])
"""


@pytest.mark.slow  # the default run's time: make test-slow runs it
def test_the_drill_fails_against_an_agent_without_the_data_bounds_check(tmp_path, capsys):
    drill = Drill(tmp_path, agent_argv=[sys.executable, "-c", WEAKENED])
    try:
        ok = drill.run(tmp_path)
    finally:
        drill.close()
    out = capsys.readouterr().out
    assert not ok
    missed = [what for what, refused, _ in drill.results if not refused]
    assert missed == ["two DATA prefixes of 1 GiB with no payload, signed"], out[-3000:]
    assert "13 of 14 attempts on the agent refused by it" in out


def test_a_dead_agent_refuses_nothing(tmp_path):
    drill = Drill(tmp_path)
    try:
        drill.commit()
        drill.agent.send_signal(signal.SIGKILL)
        drill.agent.wait(timeout=10)
        drill.attempt("anonymous GET", drill.anonymous_get)
        drill.attempt("GET signed with a key that is not the job's", drill.forged_get)
    finally:
        drill.close()
    assert [refused for _, refused, _ in drill.results] == [False, False]
