"""Counters one FFN rank keeps and reports to the coordinator."""

from __future__ import annotations

from dataclasses import dataclass

from afd_ray.observability.timeline import StepSplit

__all__ = ["FFNStats"]


@dataclass(frozen=True)
class FFNStats:
    """Counters of one FFN rank since start; replaced whole at each step boundary, so a
    snapshot read from another thread is always consistent."""

    steps: int = 0
    """Forward steps served."""
    layers: int = 0
    """FFN layer computations (steps x layers)."""
    tokens: int = 0
    """Token rows served, summed over steps (not over layers)."""
    busy_s: float = 0.0
    """Wall time spent inside steps (receive + compute + send), seconds."""
    a2f_bytes: int = 0
    """Bytes received from attention peers (hidden states, and top-k ids and weights
    with `gate_on_attention`), summed over layers."""
    f2a_bytes: int = 0
    """Bytes sent back to attention peers (FFN outputs), summed over layers."""
    split: StepSplit = StepSplit()
    """The step split of the timed steps (`afd_ray.observability.timeline`)."""
    compute_s: float = 0.0
    """FFN compute, EP collectives excluded, summed over steps, seconds (host time: on
    CUDA, launch times). With EP the rank holding the hot experts has the most: the
    straggler of every step (docs/eplb.md)."""
    ep_s: float = 0.0
    """EP collectives (all-gathers, reduce-scatters), summed over steps, seconds: with
    EP the other ranks wait for the straggler here."""
