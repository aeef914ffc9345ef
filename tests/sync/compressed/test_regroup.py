"""Per-group state re-laid out when fusion groups change (ddlscale.sync.compressed.regroup)."""

import pytest
import torch

from ddlscale.sync.compressed.regroup import GroupLayout, regroup

A, B, C = ("a", 3), ("b", 2), ("c", 4)


def test_fused_state_splits_and_joins_by_member():
    state = {"a+b": torch.arange(5.0), "c": torch.arange(10.0, 14.0)}
    regroup([state], {"a+b": GroupLayout((A, B)), "c": GroupLayout((C,))},
            {"a": GroupLayout((A,)), "b+c": GroupLayout((B, C))})
    assert sorted(state) == ["a", "b+c"]
    assert torch.equal(state["a"], torch.arange(3.0))
    assert torch.equal(state["b+c"], torch.tensor([3.0, 4.0, 10.0, 11.0, 12.0, 13.0]))


def test_members_without_state_start_at_zero_and_foreign_keys_stay():
    kept = torch.ones(4)
    state = {"a": torch.full((3,), 2.0), "restored": kept}
    regroup([state], {"a": GroupLayout((A,)), "b": GroupLayout((B,))}, {"b+a": GroupLayout((B, A))})
    assert torch.equal(state["b+a"], torch.tensor([0.0, 0.0, 2.0, 2.0, 2.0]))
    assert state["restored"] is kept


def test_unchanged_groups_are_left_alone():
    tensor = torch.arange(3.0)
    state = {"a": tensor}
    regroup([state], {"a": GroupLayout((A,)), "b": GroupLayout((B,))}, {"a": GroupLayout((A,))})
    assert state["a"] is tensor


def test_a_hierarchical_chunk_lands_at_its_ranks_position():
    # 5 elements over a machine of 2: chunks of 3, the second one holds the last 2 (the padding is no state).
    state = {"a+b@machine": torch.tensor([7.0, 8.0])}
    regroup([state], {"a+b@machine": GroupLayout((A, B), machine=(1, 2))}, {"a+b": GroupLayout((A, B))})
    assert torch.equal(state["a+b"], torch.tensor([0.0, 0.0, 0.0, 7.0, 8.0]))


def test_moving_into_a_hierarchical_group_sums_over_the_machine():
    seen = []

    def machine_sum(tensor):  # a machine of 2 whose other rank holds [10, 10, 10, 10, 10]
        seen.append(tensor.clone())
        tensor += 10.0

    state = {"a": torch.arange(1.0, 4.0), "b": torch.arange(4.0, 6.0)}
    regroup([state], {"a": GroupLayout((A,)), "b": GroupLayout((B,))},
            {"a+b@machine": GroupLayout((A, B), machine=(1, 2))}, machine_sum)
    assert torch.equal(seen[0], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert torch.equal(state["a+b@machine"], torch.tensor([14.0, 15.0]))
    with pytest.raises(ValueError, match="machine's sum"):
        regroup([{"a": torch.ones(3)}], {"a": GroupLayout((A,))}, {"a@machine": GroupLayout((A,), machine=(0, 2))})


def test_a_leader_holds_the_whole_group_and_its_other_ranks_none():
    """PowerSGD's hierarchical groups run whole at the machine's first rank: its state is the whole
    buffer there and empty at the others, and it moves to and from flat groups like a chunk does."""
    leader = {"a+b@machine": torch.arange(5.0)}
    other = {"a+b@machine": torch.zeros(0)}
    before = {"a+b@machine": GroupLayout((A, B), machine=(0, 2), leader=True)}
    regroup([leader], before, {"a": GroupLayout((A,)), "b": GroupLayout((B,))})
    regroup([other], {"a+b@machine": GroupLayout((A, B), machine=(1, 2), leader=True)},
            {"a": GroupLayout((A,)), "b": GroupLayout((B,))})
    assert torch.equal(leader["a"], torch.arange(3.0)) and torch.equal(leader["b"], torch.tensor([3.0, 4.0]))
    assert torch.equal(other["a"], torch.zeros(3)) and torch.equal(other["b"], torch.zeros(2))
    state = {"a": torch.ones(3), "b": torch.ones(2)}
    regroup([state], {"a": GroupLayout((A,)), "b": GroupLayout((B,))},
            {"a+b@machine": GroupLayout((A, B), machine=(1, 2), leader=True)}, lambda t: t.mul_(2))
    assert state["a+b@machine"].numel() == 0  # the sum went to the leader
