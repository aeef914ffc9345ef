"""Per-group state re-laid out when fusion groups change (ddlscale.sync.compress.regroup)."""

import pytest
import torch

from ddlscale.sync.compress.regroup import GroupLayout, regroup

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
    # 5 elements over a machine of 2: chunks of 3, the second one's last element is padding.
    state = {"a+b@machine": torch.tensor([7.0, 8.0, 9.0])}
    regroup([state], {"a+b@machine": GroupLayout((A, B), machine=(1, 2))}, {"a+b": GroupLayout((A, B))})
    assert torch.equal(state["a+b"], torch.tensor([0.0, 0.0, 0.0, 7.0, 8.0]))


def test_moving_into_a_hierarchical_group_reduce_scatters():
    seen = []

    def reduce_scatter(chunk, whole):  # a machine of 2 whose other rank holds nothing
        seen.append(whole.clone())
        chunk.copy_(whole[3:6])

    state = {"a": torch.arange(1.0, 4.0), "b": torch.arange(4.0, 6.0)}
    regroup([state], {"a": GroupLayout((A,)), "b": GroupLayout((B,))},
            {"a+b@machine": GroupLayout((A, B), machine=(1, 2))}, reduce_scatter)
    assert torch.equal(seen[0], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 0.0]))
    assert torch.equal(state["a+b@machine"], torch.tensor([4.0, 5.0, 0.0]))
    with pytest.raises(ValueError, match="reduce_scatter"):
        regroup([{"a": torch.ones(3)}], {"a": GroupLayout((A,))}, {"a@machine": GroupLayout((A,), machine=(0, 2))})
