"""Rules that each have a test failing when the rule is broken (issue 44 item 8): replicas acknowledged by
machines outside the placement plan never count; a version's BEGIN waits for the previous version's
outcome; a DATA chunk beyond its version's announced size is refused before a byte lands."""

import threading
import time

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer
from ddlscale.ckpt.gemini.interleave import Transfer
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.protocol import REFUSED, REPLY
from ddlscale.ckpt.version.checksum import checksum


def test_holders_outside_the_placement_plan_never_count():
    plan = PlacementPlan(4, 2, "group")  # groups {0, 1} and {2, 3}
    machine_of = [0, 1, 2, 3]
    inside = [list(plan.holders_of(m)) for m in machine_of]
    assert plan.verified(inside, machine_of) == 8
    # Rank 0's replicas "verified" by machines 2 and 3, which do not hold machine 0's checkpoint.
    outside = [[2, 3], *inside[1:]]
    assert plan.verified(outside, machine_of) == 6
    # Each holder once: an acknowledgement repeated is one replica.
    repeated = [[0, 0, 0, 0], *inside[1:]]
    assert plan.verified(repeated, machine_of) == 7


def test_the_next_begin_waits_for_the_previous_versions_outcome(job):
    gemini = GeminiCheckpointer(commit_timeout_s=5)
    # A connection of its own: the waiting thread blocks it (as the sender thread's is its own).
    gemini.store = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)
    gemini.incarnation = job.incarnation
    gemini._before_begin(_transfer(1))
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (gemini._before_begin(_transfer(2)), returned.set()), daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert not returned.is_set()  # version 1 undecided: version 2's BEGIN must not go out yet
    job.decide(1, "committed")
    assert returned.wait(5)
    assert gemini.previous.version == 2


def _transfer(version):
    transfer = Transfer.__new__(Transfer)
    transfer.version, transfer.outcome = version, None
    return transfer


def test_a_data_chunk_beyond_its_versions_size_is_refused_before_a_byte_lands(job, agent):
    nbytes = 4096
    with job.client(agent) as client:
        client.begin(1, 0, nbytes)
        client.data(1, 0, 0, [memoryview(b"a" * nbytes)])
        client.data(1, 0, nbytes - 16, [memoryview(b"b" * 64)])  # 48 bytes past the end
        header = client.sock.recv(REPLY.size, 0)
        status = REPLY.unpack(header)[0]
    assert status == REFUSED and agent.refusals["bounds"] == 1
    slot = agent.replicas.writing(0, 1, job.incarnation)
    assert bytes(slot.view()) == b"a" * nbytes  # nothing of the refused chunk landed
    with job.client(agent) as client:  # the version can still be completed by a well-behaved sender
        client.end(1, 0, checksum(b"a" * nbytes, "hmac-sha256", job.auth.replica))
