"""Expert -> EP rank placement."""

from __future__ import annotations

import pytest

from afd_ray.eplb.contiguous import expert_owner, owned_experts


@pytest.mark.parametrize(
    ("num_experts", "ep_size", "sizes"), [(8, 1, [8]), (8, 2, [4, 4]), (10, 3, [4, 3, 3]), (3, 3, [1, 1, 1])]
)
def test_contiguous_balanced_blocks(num_experts, ep_size, sizes):
    owner = expert_owner(num_experts, ep_size)
    assert owner == sorted(owner)
    assert [owner.count(r) for r in range(ep_size)] == sizes
    blocks = [owned_experts(num_experts, ep_size, r) for r in range(ep_size)]
    assert [e for block in blocks for e in block] == list(range(num_experts))
    assert all(owner[e] == r for r, block in enumerate(blocks) for e in block)


@pytest.mark.parametrize(("num_experts", "ep_size", "ep_rank"), [(8, 0, 0), (4, 5, 0), (8, 2, 2), (8, 2, -1)])
def test_bad_arguments_raise(num_experts, ep_size, ep_rank):
    with pytest.raises(ValueError):
        owned_experts(num_experts, ep_size, ep_rank)
