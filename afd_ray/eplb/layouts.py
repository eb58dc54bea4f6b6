"""The expert placement of a new FFN layout: a rebalance over the same ranks, or a
resize or recovery that changes them (docs/eplb.md). Pure: no process, no Ray.

The policy's placement (`afd_ray.eplb.policy.place_layer`) for the layout's EP size,
from the pool's window load, layer by layer against a baseline: the serving placement
when the new layout has the same EP size (a rebalance, or a recovery that replaces a
lost rank), else the contiguous blocks of the new size. A layer takes the policy's
placement only if that raises its balancedness by at least `min_gain` (the policy's
hysteresis); where no layer does, the baseline stays. A baseline layer whose slots do
not split evenly over the ranks (contiguous blocks of 10 experts on 3 ranks: 4, 3, 3)
cannot sit beside the policy's layers of equal slot counts, so once any layer moves,
such a layer takes the policy's placement too.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_ray.eplb.policy import balancedness, place_layer
from afd_ray.eplb.slots import Slots, default_slots, rank_rows, redundant_for

__all__ = ["layout_placement"]


def layout_placement(
    load: Sequence[Sequence[float]],
    ep_size: int,
    num_redundant_experts: int,
    min_gain: float,
    current: Sequence[Slots] | None = None,
) -> tuple[Slots, ...] | None:
    """The placement of every MoE layer of a new layout of `ep_size` FFN ranks.

    Args:
        load: `[L][E]` routed rows per MoE layer and logical expert over the window
            (summed over the FFN ranks).
        ep_size: EP ranks of the new layout.
        num_redundant_experts: `ffn.eplb.num_redundant_experts`; this size uses
            `redundant_for` of it.
        min_gain: a layer leaves its baseline only if its balancedness rises this much.
        current: the serving placement `[L][EP rank]` of the same EP size (the
            baseline); None: the contiguous blocks of `ep_size` ranks are.

    Returns:
        `[L][EP rank]` the logical expert of each slot; None: the contiguous blocks
        (no load in the window, no EPLB placement at this size (`redundant_for`), or
        the result is the contiguous blocks).

    Raises:
        ValueError: `current` disagrees with `load` on the layers or with `ep_size`,
            or a negative load (`place_layer`).
    """
    if not load or not any(any(rows) for rows in load):
        return None
    num_experts = len(load[0])
    if not 1 <= ep_size <= num_experts:
        return None
    redundant = redundant_for(num_experts, ep_size, num_redundant_experts)
    if redundant is None:
        return None
    blocks = default_slots(num_experts, ep_size)
    baseline = [blocks] * len(load) if current is None else list(current)
    if len(baseline) != len(load) or any(len(slots) != ep_size for slots in baseline):
        raise ValueError(f"current placement: {len(baseline)} layers on {ep_size} EP ranks expected for the load")
    proposed = [place_layer(rows, ep_size, redundant).slots for rows in load]
    gains = [
        balancedness(rank_rows(new, rows)) - balancedness(rank_rows(old, rows))
        for rows, new, old in zip(load, proposed, baseline, strict=True)
    ]
    placed = baseline
    if any(gain >= min_gain for gain in gains):
        placed = [
            new if gain >= min_gain or len({len(rank) for rank in old}) != 1 else old
            for new, old, gain in zip(proposed, baseline, gains, strict=True)
        ]
    return None if all(slots == blocks for slots in placed) else tuple(placed)
