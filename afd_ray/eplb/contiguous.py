"""Expert parallelism placement: which EP rank owns which routed expert."""

from __future__ import annotations

__all__ = ["expert_owner", "owned_experts"]


def expert_owner(num_experts: int, ep_size: int) -> list[int]:
    """Owner EP rank of each routed expert: contiguous, balanced blocks.

    Rank r owns a block of `num_experts // ep_size` experts, plus one more for the
    first `num_experts % ep_size` ranks (10 experts on 3 ranks: 4, 3, 3). The same
    placement holds for every MoE layer.

    Returns:
        `owner[e]` for `e` in `[0, num_experts)`, non-decreasing.

    Raises:
        ValueError: `ep_size < 1`, or more ranks than experts (a rank would own none).
    """
    if not 1 <= ep_size <= num_experts:
        raise ValueError(f"ep_size must be in [1, {num_experts}] for {num_experts} experts, got {ep_size}")
    base, extra = divmod(num_experts, ep_size)
    return [rank for rank in range(ep_size) for _ in range(base + (rank < extra))]


def owned_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The contiguous block of experts that `ep_rank` owns under `expert_owner`.

    Raises:
        ValueError: as `expert_owner`, or `ep_rank` not in `[0, ep_size)`.
    """
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
    owner = expert_owner(num_experts, ep_size)
    return range(owner.index(ep_rank), len(owner) - owner[::-1].index(ep_rank))
