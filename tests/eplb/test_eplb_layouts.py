"""The expert placement of a new FFN layout (`afd_ray.eplb.layouts`): a resize or a
recovery keeps the placement policy, without Ray."""

from __future__ import annotations

import pytest

from afd_ray.eplb.layouts import layout_placement
from afd_ray.eplb.policy import place_layer
from afd_ray.eplb.slots import default_slots, layer_balancedness

pytestmark = pytest.mark.timeout(30)

SKEWED = [[100, 90, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 50, 80]]
"""Routed rows per expert of two MoE layers (8 experts), hot experts in one block."""
BALANCED = [[10] * 8, [10] * 8]


def _even(slots: tuple[tuple[int, ...], ...]) -> bool:
    return len({len(rank) for rank in slots}) == 1


@pytest.mark.parametrize(("ep_size", "redundant", "per_rank"), [(2, 2, 5), (3, 2, 3), (4, 0, 2), (4, 2, 2)])
def test_a_new_size_takes_the_policys_placement_of_the_window(ep_size: int, redundant: int, per_rank: int) -> None:
    """A resize to `ep_size` ranks: every layer gets the policy's placement for that
    size (`redundant_for` slots: 8 + 1 on 3 ranks, 8 + 0 on 4 ranks with 2 wanted),
    far more balanced than the contiguous blocks; deterministic."""
    placed = layout_placement(SKEWED, ep_size, redundant, 0.02)
    assert placed is not None and placed == layout_placement(SKEWED, ep_size, redundant, 0.02)
    assert all(len(slots) == ep_size and _even(slots) and len(slots[0]) == per_rank for slots in placed)
    assert all({e for rank in slots for e in rank} == set(range(8)) for slots in placed)
    blocks = layer_balancedness(SKEWED, [default_slots(8, ep_size)] * 2)
    after = layer_balancedness(SKEWED, placed)
    assert all(a > b + 0.15 for a, b in zip(after, blocks, strict=True)), (blocks, after)


def test_no_load_or_a_balanced_load_keeps_the_contiguous_blocks() -> None:
    assert layout_placement([[0] * 8, [0] * 8], 2, 2, 0.02) is None
    assert layout_placement([], 2, 2, 0.02) is None
    assert layout_placement(BALANCED, 2, 0, 0.02) is None
    assert layout_placement(BALANCED, 4, 0, 0.02) is None
    assert layout_placement(SKEWED, 1, 0, 0.02) is None  # one rank holds every expert
    assert layout_placement([[1] * 10], 3, 0, 0.02) is None  # 10 experts on 3 ranks: no EPLB placement


def test_the_same_size_keeps_the_serving_placement_unless_the_policy_gains() -> None:
    """A recovery (same EP size): the serving placement is the baseline, so a balanced
    one stays as it is (the replacement loads the lost rank's slots); a layer of it
    that the window's load skews moves."""
    serving = tuple(place_layer(rows, 2, 2).slots for rows in SKEWED)
    assert layout_placement(SKEWED, 2, 2, 0.02, serving) == serving
    skewed_now = (serving[0], ((0, 1, 2, 6, 7), (0, 1, 3, 4, 5)))  # layer 1: both hot experts on rank 0
    placed = layout_placement(SKEWED, 2, 2, 0.02, skewed_now)
    assert placed is not None and placed[0] == serving[0] and placed[1] != skewed_now[1]
    with pytest.raises(ValueError, match="current placement"):
        layout_placement(SKEWED, 2, 2, 0.02, serving[:1])


def test_an_uneven_baseline_layer_moves_with_the_others() -> None:
    """10 experts on 3 ranks with 2 redundant: 12 slots of 4 per rank. The contiguous
    blocks (4, 3, 3) cannot sit beside them, so a balanced layer moves too once a
    skewed one does; with no layer gaining, the blocks stay."""
    skewed = [[200, 150] + [1] * 8, [10] * 10]
    placed = layout_placement(skewed, 3, 2, 0.02)
    assert placed is not None and all(_even(slots) and len(slots[0]) == 4 for slots in placed)
    even = [3] * 4 + [4] * 6  # 12 rows on each block of 4, 3, 3 experts
    assert layout_placement([even, even], 3, 2, 0.02) is None
