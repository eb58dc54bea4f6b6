"""EPLB placements as the FFN model holds them (`afd_ray.eplb.slots`): the slots a
placement gives each rank, the redundant slots a pool size uses, the balancedness per
layer. Pure: no torch tensors, no process."""

from __future__ import annotations

import pytest

from afd_ray.eplb.policy import LayerPlacement, contiguous_placement, place_layer
from afd_ray.eplb.slots import default_slots, layer_balancedness, redundant_for, slots_of
from afd_ray.layers.experts import ExpertSlots

pytestmark = pytest.mark.timeout(30)

SKEWED = [[100, 90, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 50, 80]]
"""Routed rows per expert of two MoE layers (8 experts)."""


def test_slots_number_replicas_in_rank_order() -> None:
    placement = LayerPlacement(4, ((0, 1, 2), (0, 3, 1)))
    assert slots_of(placement, 0) == ExpertSlots((0, 1, 2), (0, 0, 0), (2, 2, 1, 1))
    assert slots_of(placement, 1) == ExpertSlots((0, 3, 1), (1, 0, 1), (2, 2, 1, 1))
    assert slots_of(contiguous_placement(4, 2), 1) == ExpertSlots.block(range(2, 4), 4)
    with pytest.raises(ValueError, match="ep_rank"):
        slots_of(placement, 2)


def test_redundant_slots_fit_the_pool_size() -> None:
    assert redundant_for(8, 2, 2) == 2
    assert redundant_for(8, 3, 4) == 4  # 12 slots, 4 a rank
    assert redundant_for(8, 3, 3) == 1  # 9 slots; 11 would not split over 3 ranks
    assert redundant_for(8, 2, 20) == 8  # one replica per rank at most: 8 * (2 - 1)
    assert redundant_for(10, 3, 0) is None  # 10 experts on 3 ranks: only the default blocks


def test_balancedness_per_layer_follows_the_placement() -> None:
    contiguous = [default_slots(8, 2)] * 2
    before = layer_balancedness(SKEWED, contiguous)
    assert before == pytest.approx([(196 / 2) / 192, (136 / 2) / 132])
    placed = [place_layer(load, 2, 2).slots for load in SKEWED]
    after = layer_balancedness(SKEWED, placed)
    assert all(a > b + 0.3 for a, b in zip(after, before, strict=True)), (before, after)
    assert layer_balancedness([[0] * 8], [default_slots(8, 2)]) == [1.0]
    with pytest.raises(ValueError, match="MoE layers"):
        layer_balancedness(SKEWED, contiguous[:1])
