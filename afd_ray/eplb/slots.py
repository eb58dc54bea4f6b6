"""EPLB placements as the FFN model holds them, and the load they balance (docs/eplb.md).

Pure functions between the policy (`afd_ray.eplb.policy`: `LayerPlacement` per
MoE layer) and the model (`afd_ray.layers.experts.ExpertSlots` per rank and layer);
no tensors, no process.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_ray.eplb.policy import LayerPlacement, balancedness
from afd_ray.eplb.contiguous import owned_experts
from afd_ray.layers.experts import ExpertSlots

__all__ = ["default_slots", "layer_balancedness", "layer_placements", "rank_rows", "redundant_for", "slots_of"]

Slots = tuple[tuple[int, ...], ...]
"""`slots[rank]`: the logical expert of each of that EP rank's physical slots."""


def slots_of(placement: LayerPlacement, rank: int) -> ExpertSlots:
    """EP rank `rank`'s slots of `placement`: replica j of expert e is the j-th slot
    holding e in rank order, then slot order (`ExpertSlots`).

    Raises:
        ValueError: `rank` not in `[0, placement.ep_size)`.
    """
    if not 0 <= rank < placement.ep_size:
        raise ValueError(f"ep_rank must be in [0, {placement.ep_size}), got {rank}")
    seen = [0] * placement.num_experts
    mine: list[int] = []
    for r, experts in enumerate(placement.slots):
        for expert in experts:
            if r == rank:
                mine.append(seen[expert])
            seen[expert] += 1
    return ExpertSlots(placement.slots[rank], tuple(mine), tuple(seen))


def layer_placements(placements: Sequence[Slots] | None) -> list[LayerPlacement] | None:
    """`LayerPlacement`s of `[MoE layer][EP rank]` slots as an `EPAssignment` carries
    them (None: contiguous blocks).

    Raises:
        ValueError: a layer's slots leave an expert out (`LayerPlacement`).
    """
    if placements is None:
        return None
    return [LayerPlacement(1 + max(max(rank) for rank in slots), tuple(slots)) for slots in placements]


def default_slots(num_experts: int, ep_size: int) -> Slots:
    """The placement without EPLB: contiguous blocks (`placement.owned_experts`)."""
    return tuple(tuple(owned_experts(num_experts, ep_size, rank)) for rank in range(ep_size))


def redundant_for(num_experts: int, ep_size: int, wanted: int) -> int | None:
    """The redundant slots a pool of `ep_size` ranks uses when `wanted` are configured
    (`ffn.eplb.num_redundant_experts`): the largest count <= `wanted` and <=
    `num_experts * (ep_size - 1)` (one replica per rank at most) with which the slots
    split evenly over the ranks; None when there is none (no EPLB at this size: the
    default placement serves)."""
    for redundant in range(min(wanted, num_experts * (ep_size - 1)), -1, -1):
        if (num_experts + redundant) % ep_size == 0:
            return redundant
    return None


def rank_rows(slots: Slots, load: Sequence[float]) -> list[float]:
    """Rows each EP rank computes when expert e gets `load[e]` rows spread evenly over
    its replicas (`LayerPlacement.rank_loads`, for any slot counts)."""
    replicas = [0] * len(load)
    for experts in slots:
        for expert in experts:
            replicas[expert] += 1
    return [sum(load[e] / replicas[e] for e in experts) for experts in slots]


def layer_balancedness(load: Sequence[Sequence[float]], slots: Sequence[Slots]) -> list[float]:
    """Balancedness (mean over max of the EP ranks' routed rows, `balancedness`) of
    each MoE layer: `load[l][e]` rows over the window, `slots[l]` its placement.

    Raises:
        ValueError: `load` and `slots` disagree on the layer count.
    """
    if len(load) != len(slots):
        raise ValueError(f"load has {len(load)} MoE layers, the placement {len(slots)}")
    return [balancedness(rank_rows(placed, rows)) for rows, placed in zip(load, slots, strict=True)]
