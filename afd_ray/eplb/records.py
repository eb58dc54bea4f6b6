"""EPLB records as `/afd/status` shows them (JSON-serializable; `afd_ray.control.eplb`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["EPLBEvent", "EPLBStatus"]


class EPLBEvent(BaseModel):
    """One rebalance of the expert placement, as `/afd/status` shows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: str
    """`manual` (POST /afd/eplb) or `policy`."""
    started_s: float
    """Unix time it began, seconds."""
    epoch: int | None = None
    """Layout epoch of the new placement (None: nothing moved)."""
    layers_moved: int = 0
    """MoE layers whose placement changed (0 when the switch failed: none did)."""
    balancedness_before: float | None = None
    """Mean over the MoE layers of the balancedness of the window's load under the old
    placement; None for a refused rebalance (no load read)."""
    balancedness_after: float | None = None
    """The same under the placement that serves afterwards (on the same window's load:
    the old one when nothing moved or the switch failed); None for a refused rebalance."""
    duration_s: float = 0.0
    pause_s: float = 0.0
    """Longest step-boundary pause of an FFN rank during the switch, seconds."""
    bytes_loaded: int = 0
    """Weight bytes the FFN ranks read from the checkpoint for their new slots."""
    error: str | None = None


class EPLBStatus(BaseModel):
    """The `eplb` field of `/afd/status`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool
    """`ffn.eplb.enabled`: the policy rebalances by itself."""
    balancedness: list[float]
    """Per MoE layer (in layer order): mean over max of the EP ranks' routed rows in the
    window, under the placement in use (1 = balanced)."""
    rank_rows: list[float]
    """Routed rows each EP rank computed in the window, over all MoE layers."""
    window_rows: int
    """Routed rows in the window, all layers and ranks."""
    num_redundant_experts: int = 0
    """Redundant slots per layer of the placement in use (the most of any layer: a layer
    that would gain less than `min_gain` keeps its earlier placement)."""
    placements: list[list[list[int]]] = []
    """`[layer][EP rank]`: the logical expert of each slot (empty: contiguous blocks)."""
    rebalances: list[EPLBEvent] = []
    """Rebalances so far, oldest first."""
