"""The EPLB placement policy (`afd_ray.eplb.policy`): a pure function, tested without
Ray or torch on skewed and balanced loads."""

from __future__ import annotations

import pytest

from afd_ray.eplb.policy import (
    LayerPlacement,
    balancedness,
    contiguous_placement,
    place_layer,
    rebalance,
)

pytestmark = pytest.mark.timeout(30)


def _zipf(num_experts: int, exponent: float = 1.2) -> list[float]:
    """Rows per expert of a skewed router: expert e gets 1000 / (e + 1)^exponent rows."""
    return [1000.0 / (e + 1) ** exponent for e in range(num_experts)]


@pytest.mark.parametrize("redundant", [0, 4, 8])
def test_every_expert_placed_within_the_slot_budget(redundant: int) -> None:
    placement = place_layer(_zipf(16), ep_size=4, num_redundant_experts=redundant)
    replicas = placement.replicas()
    assert all(count >= 1 for count in replicas)
    assert sum(replicas) == 16 + redundant
    assert {len(rank) for rank in placement.slots} == {(16 + redundant) // 4}
    for rank in placement.slots:  # two replicas of one expert never share a rank here
        assert len(set(rank)) == len(rank)


def test_deterministic() -> None:
    load = _zipf(32)
    assert place_layer(load, 4, 8) == place_layer(list(load), 4, 8)
    current = [contiguous_placement(32, 4)] * 3
    assert rebalance([load] * 3, current, 8) == rebalance([list(load)] * 3, current, 8)


def test_skewed_load_gets_more_balanced_and_redundancy_helps() -> None:
    load = _zipf(16, exponent=1.5)
    before = balancedness(contiguous_placement(16, 4).rank_loads(load))
    without = balancedness(place_layer(load, 4, 0).rank_loads(load))
    with_redundant = balancedness(place_layer(load, 4, 4).rank_loads(load))
    assert before < 0.5, before  # the hot experts 0-3 all sit on rank 0
    assert without > before + 0.1, (before, without)  # expert 0 alone caps it near 0.5
    assert with_redundant > without + 0.2, (without, with_redundant)


def test_one_hot_expert_is_replicated_on_every_rank() -> None:
    load = [1.0] * 8
    load[5] = 1000.0
    placement = place_layer(load, ep_size=4, num_redundant_experts=4)
    assert placement.replicas()[5] == 4
    assert all(5 in rank for rank in placement.slots)
    assert balancedness(placement.rank_loads(load)) > 0.95


def test_balanced_load_keeps_the_current_placement() -> None:
    current = [contiguous_placement(16, 4), contiguous_placement(16, 4)]
    result = rebalance([[10.0] * 16, [0.0] * 16], current, num_redundant_experts=0)
    assert result[0] is current[0] and result[1] is current[1]


def test_rebalance_moves_only_the_skewed_layer() -> None:
    current = [contiguous_placement(16, 4), contiguous_placement(16, 4)]
    result = rebalance([[10.0] * 16, _zipf(16)], current, num_redundant_experts=0)
    assert result[0] is current[0]
    assert result[1] is not current[1]
    assert balancedness(result[1].rank_loads(_zipf(16))) > balancedness(current[1].rank_loads(_zipf(16)))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: place_layer([1.0, -1.0], 2, 0), "load must be >= 0"),
        (lambda: place_layer([1.0] * 6, 4, 0), "split evenly"),
        (lambda: place_layer([1.0] * 8, 4, 1), "split evenly"),
        (lambda: place_layer([1.0] * 2, 2, 4), "at most one replica of an expert per EP rank"),
        (lambda: contiguous_placement(6, 4), "split evenly"),
        (lambda: LayerPlacement(4, ((0, 1), (1, 2))), "missing \\[3\\]"),
        (lambda: LayerPlacement(4, ((0, 1, 2), (3,))), "same number of slots"),
        (lambda: rebalance([[1.0] * 8], [], 0), "1 layers"),
        (lambda: rebalance([[1.0] * 4], [contiguous_placement(8, 2)], 0), "4 experts"),
    ],
)
def test_bad_input_names_the_problem(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
