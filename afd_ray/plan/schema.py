"""The profile file of `afd-ray profile`, read by `afd-ray plan`: `Profile` and its parts.

Times are milliseconds per decode step (summed over the model's layers), sizes bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Link", "Profile", "StepPoint", "Verdict"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StepPoint(_Record):
    """One decode step of the colocated model at one batch size and context."""

    batch: int = Field(ge=1)
    """Sequences decoding together, i.e. tokens in the step."""
    context: float = Field(ge=0)
    """Mean context length of those sequences during the measured steps, tokens."""
    step_ms: float = Field(gt=0)
    """Whole engine step (scheduling, forward, sampling), ms."""
    attention_ms: float = Field(ge=0)
    """The attention halves of all layers (norm, QKV, attention, output projection), ms."""
    ffn_ms: float = Field(ge=0)
    """The FFN halves of all layers (dense MLP, or MoE gate + experts), ms."""
    comm_ms: float = Field(0.0, ge=0)
    """Collective communication inside the step (0 on one device), ms."""

    @property
    def other_ms(self) -> float:
        """`step_ms - attention_ms - ffn_ms - comm_ms`: embedding, LM head, sampling,
        scheduling; stays with the attention role under AFD."""
        return max(self.step_ms - self.attention_ms - self.ffn_ms - self.comm_ms, 0.0)


class Link(_Record):
    """The A2F/F2A link: `time(message of n bytes) = latency + n / bandwidth`."""

    latency_us: float = Field(ge=0)
    """Fixed cost of one message (one direction, one layer), microseconds."""
    bandwidth_gbps: float = Field(gt=0)
    """Bytes per second of one direction, 10^9."""
    source: str
    """How it was measured."""


class Verdict(_Record):
    """Whether AFD can pay at one batch size, from the colocated profile alone."""

    batch: int
    ffn_share: float
    """`ffn_ms / step_ms`."""
    bytes_per_step: float
    """The AFD traffic per step (docs/models.md), A2F + F2A bytes: `2 × L × batch × H × bytes_per_elem`."""
    transfer_ms: float
    """Those bytes over the link, with its latency per message (`2 × L` messages)."""
    can_pay: bool
    reason: str


class Profile(_Record):
    """What `afd-ray plan` needs about one model on one kind of device."""

    model: str
    device: str
    """Where it was measured (CPU model, or the GPU's name)."""
    source: str
    """Which tool measured it (`afd-ray profile` with its profiler, or the GPU bench JSON)."""
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    bytes_per_elem: int = Field(ge=1)
    moe: bool
    """Routed experts: FFN ranks then shard them (EP) and split the FFN's weight reads."""
    points: list[StepPoint] = Field(min_length=1)
    link: Link
    verdicts: list[Verdict] = []
