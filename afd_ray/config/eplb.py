"""`ffn.eplb`: expert load balancing across the FFN pool's EP ranks (docs/eplb.md).

The names are vLLM's `EPLBConfig` (`--eplb-config`) where they mean the same.
"""

from __future__ import annotations

from pydantic import Field

from afd_ray.config.base import Section

__all__ = ["EPLBConfig"]


class EPLBConfig(Section):
    """Expert load balancing of the FFN pool (vLLM's `--enable-eplb` and `eplb_config`).

    The routed-row load per (MoE layer, expert) is always counted over the last
    `window_size` FFN steps and shown in `/afd/status` (`eplb`) and the
    `afd_eplb_balancedness` metric; `enabled` lets the coordinator also move experts.
    """

    enabled: bool = False
    """Rebalance the expert placement while serving (vLLM's `enable_eplb`): every
    `step_interval` FFN steps when a layer's balancedness is under
    `balancedness_bound`, and on `POST /afd/eplb` (which works even when this is False)."""

    window_size: int = Field(1000, ge=1, le=100_000)
    """FFN steps of routed-row load each FFN rank keeps per (MoE layer, expert), a
    sliding window (vLLM's `window_size`). Each rank holds a `[window_size, L, E]`
    int64 tensor on its device: 8·window_size·L·E bytes (DeepSeek-V3, 1000 steps:
    118 MB, as vLLM's)."""

    step_interval: int = Field(3000, ge=1)
    """FFN steps between two evaluations of the policy (vLLM's `step_interval`)."""

    num_redundant_experts: int = Field(0, ge=0)
    """Extra physical expert slots per MoE layer over the whole pool (vLLM's name):
    the hottest experts get a replica on another rank. Every rank then holds
    `(E + num_redundant_experts) / ep_size` experts per layer. At most one replica of an
    expert per rank, so at most `E·(ep_size - 1)`; with a pool size that does not divide
    `E + num_redundant_experts`, the largest count that does is used
    (`afd_ray.eplb.slots.redundant_for`). Needs `ffn.min_ranks` >= 2."""

    log_balancedness: bool = False
    """Log the balancedness of every MoE layer at every policy evaluation (vLLM's
    `log_balancedness`); it is always in `/afd/status` and the metric."""

    balancedness_bound: float = Field(0.9, gt=0, le=1)
    """The policy rebalances when the mean balancedness over the MoE layers (mean
    over max of the EP ranks' routed rows, 1 = balanced) is under this."""

    min_gain: float = Field(0.02, ge=0, lt=1)
    """A layer moves only if the new placement raises its balancedness on the window's
    load by at least this much (`afd_ray.eplb.policy.rebalance`)."""
