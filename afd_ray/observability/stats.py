"""Counters one FFN rank keeps and reports to the coordinator."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    split_steps: int = 0
    """Timed steps whose device-timeline split is summed in `split_*_s`
    (`afd_ray.observability.timeline`: every step on CPU, a sample on CUDA; a step
    starting over `timeline.IDLE_GAP_S` after the previous one is not timed). Divide the sums by it for means per step."""
    split_attention_s: float = 0.0
    """Timed steps: waits for each later layer's rows (the attention rank's per-layer
    work and the A2F transfer), seconds on the FFN rank's timeline."""
    split_wire_s: float = 0.0
    """Timed steps: F2A copies and signals queued on the FFN rank, seconds."""
    split_ffn_s: float = 0.0
    """Timed steps: FFN compute, EP collectives included, seconds."""
    split_idle_s: float = 0.0
    """Timed steps: previous step's last F2A to the first layer's rows, seconds."""

    def plus_split(self, split: StepSplit) -> FFNStats:
        """These counters with `split` added to the `split_*` fields."""
        if not split.steps:
            return self
        return replace(
            self,
            split_steps=self.split_steps + split.steps,
            split_attention_s=self.split_attention_s + split.attention_s,
            split_wire_s=self.split_wire_s + split.wire_s,
            split_ffn_s=self.split_ffn_s + split.ffn_s,
            split_idle_s=self.split_idle_s + split.idle_s,
        )
