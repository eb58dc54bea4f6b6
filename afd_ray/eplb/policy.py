"""Expert placement for load balancing across the FFN pool's EP ranks (EPLB policy).

A pure function of the routed-row load: no Ray, no torch, no process. The FFN pool
applies what it returns (issue 34); this module only decides.

The algorithm follows vLLM's default EPLB policy (`vllm.distributed.eplb`,
`rebalance_experts` without its node/group hierarchy, after DeepSeek's EPLB,
github.com/deepseek-ai/EPLB):
1. Replicate: the `num_redundant_experts` extra physical slots go, one at a time, to the
   logical expert with the highest load per replica (`load[e] / replicas[e]`) among those
   with fewer replicas than ranks, ties to the lower expert id.
2. Pack: every replica carries `load[e] / replicas[e]` rows (rows of a replicated expert
   are spread evenly over its replicas). Replicas, heaviest first (ties: lower expert id,
   then replica order), go to the rank with the least load that still has a free slot,
   ties to the lower rank.

What differs from vLLM's:
- An expert gets at most one replica per rank, and two replicas of one expert are never
  packed on one rank while another rank has a free slot without it (vLLM's may put them
  together, where the second replica balances nothing).
- Hysteresis: the current placement is kept unless the new one raises balancedness by
  at least `min_gain` (default 0.02), so a balanced load never moves weights, and noise
  in the window does not move them back and forth.
- Slots within a rank are sorted by expert id, so equal inputs give equal placements.

Balancedness (vLLM's `log_balancedness`): mean over max of the ranks' loads, in (0, 1];
1 is perfectly balanced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerPlacement", "balancedness", "contiguous_placement", "place_layer", "rebalance"]


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's physical expert slots: `slots[rank]` lists the logical expert
    of each of that EP rank's slots (every rank has the same number of slots).

    Raises:
        ValueError: ranks with different slot counts, or an expert id outside
            `[0, num_experts)`, or a logical expert without any slot.
    """

    num_experts: int
    slots: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len({len(rank) for rank in self.slots}) != 1:
            raise ValueError(f"every EP rank must have the same number of slots, got {[len(r) for r in self.slots]}")
        placed = {expert for rank in self.slots for expert in rank}
        if not placed <= set(range(self.num_experts)):
            raise ValueError(f"expert ids must be in [0, {self.num_experts}), got {sorted(placed)}")
        if len(placed) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - placed)
            raise ValueError(f"every logical expert needs a slot; missing {missing}")

    @property
    def ep_size(self) -> int:
        """EP ranks."""
        return len(self.slots)

    def replicas(self) -> list[int]:
        """`replicas[e]`: physical slots holding logical expert `e`."""
        counts = [0] * self.num_experts
        for rank in self.slots:
            for expert in rank:
                counts[expert] += 1
        return counts

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Rows each rank computes when expert `e` receives `load[e]` rows, spread evenly
        over its replicas."""
        counts = self.replicas()
        return [sum(load[expert] / counts[expert] for expert in rank) for rank in self.slots]


def balancedness(loads: Sequence[float]) -> float:
    """Mean over max of per-rank loads (vLLM's `log_balancedness`): in (0, 1], and 1.0
    for no load at all."""
    peak = max(loads)
    return 1.0 if peak <= 0 else sum(loads) / len(loads) / peak


def contiguous_placement(num_experts: int, ep_size: int) -> LayerPlacement:
    """The placement without EPLB: rank r holds the contiguous block of
    `num_experts // ep_size` experts (`afd_ray.eplb.contiguous.owned_experts`).

    Raises:
        ValueError: the experts do not split evenly over the ranks.
    """
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {ep_size} EP ranks")
    per = num_experts // ep_size
    return LayerPlacement(num_experts, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep_size)))


def place_layer(load: Sequence[float], ep_size: int, num_redundant_experts: int) -> LayerPlacement:
    """The balanced placement of one layer (module docstring, steps 1-2).

    Args:
        load: `[E]` routed rows per logical expert over the window (>= 0).
        ep_size: EP ranks of the FFN pool.
        num_redundant_experts: extra physical slots in all (vLLM's name); every rank
            gets `(E + num_redundant_experts) / ep_size` slots.

    Raises:
        ValueError: a negative load, fewer than one slot per rank, slots that do not
            split evenly over the ranks, or more redundant slots than
            `E * (ep_size - 1)` (an expert would need two replicas on one rank).
    """
    num_experts = len(load)
    slots = num_experts + num_redundant_experts
    if any(rows < 0 for rows in load):
        raise ValueError("load must be >= 0 for every expert")
    if num_redundant_experts < 0 or slots % ep_size or slots < ep_size:
        raise ValueError(
            f"{num_experts} experts + {num_redundant_experts} redundant must split evenly over {ep_size} EP ranks"
        )
    if num_redundant_experts > num_experts * (ep_size - 1):
        raise ValueError(
            f"num_redundant_experts {num_redundant_experts} exceeds {num_experts * (ep_size - 1)}: "
            f"at most one replica of an expert per EP rank ({ep_size} ranks)"
        )
    replicas = [1] * num_experts
    for _ in range(num_redundant_experts):
        open_experts = [e for e in range(num_experts) if replicas[e] < ep_size]
        hottest = max(open_experts, key=lambda e: (load[e] / replicas[e], -e))
        replicas[hottest] += 1
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        key=lambda item: (-item[0], item[1]),
    )
    per_rank = slots // ep_size
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    for rows, expert in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < per_rank]
        without = [r for r in free if expert not in ranks[r]]
        target = min(without or free, key=lambda r: (rank_load[r], r))
        ranks[target].append(expert)
        rank_load[target] += rows
    return LayerPlacement(num_experts, tuple(tuple(sorted(rank)) for rank in ranks))


def rebalance(
    load: Sequence[Sequence[float]],
    current: Sequence[LayerPlacement],
    num_redundant_experts: int,
    min_gain: float = 0.02,
) -> list[LayerPlacement]:
    """The placement of every MoE layer for the next window.

    Args:
        load: `[L][E]` routed rows per layer and logical expert over the window.
        current: the `L` placements in use (same EP size for every layer).
        num_redundant_experts: extra physical slots per layer (`place_layer`).
        min_gain: a layer moves only if its balancedness rises by at least this much.

    Returns:
        `L` placements; a layer's entry is `current`'s own object where it stays.

    Raises:
        ValueError: `load` and `current` disagree on layers or experts, or as
            `place_layer`.
    """
    if len(load) != len(current):
        raise ValueError(f"load has {len(load)} layers, the current placement {len(current)}")
    placements = []
    for layer, (rows, now) in enumerate(zip(load, current, strict=True)):
        if len(rows) != now.num_experts:
            raise ValueError(f"layer {layer}: load has {len(rows)} experts, the placement {now.num_experts}")
        proposed = place_layer(rows, now.ep_size, num_redundant_experts)
        gain = balancedness(proposed.rank_loads(rows)) - balancedness(now.rank_loads(rows))
        placements.append(proposed if gain >= min_gain else now)
    return placements
