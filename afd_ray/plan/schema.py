"""The profile file of `afd-ray profile`, read by `afd-ray plan`: `Profile` and its parts.

Times are milliseconds per decode step (summed over the model's layers), sizes bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Link", "PlainPoint", "Profile", "ServingPoint", "StepPoint", "Verdict"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StepPoint(_Record):
    """One decode step of the model at one batch size and context, split into the parts
    AFD puts on the attention role, the FFN role and the wire."""

    batch: int = Field(ge=1)
    """Sequences decoding together on one attention rank, i.e. token rows in the step."""
    context: float = Field(ge=0)
    """Mean context length of those sequences during the measured steps, tokens."""
    step_ms: float = Field(gt=0)
    """Whole engine step (scheduling, forward, sampling), ms."""
    attention_ms: float = Field(ge=0)
    """The attention halves of all layers (norm, QKV, attention, output projection), ms."""
    ffn_ms: float = Field(ge=0)
    """The FFN halves of all layers (dense MLP, or MoE gate + experts), ms."""
    comm_ms: float = Field(0.0, ge=0)
    """Communication inside the step (0 in a colocated CPU profile; A2F + F2A of all
    layers in a profile from the AFD app's step split), ms."""

    @property
    def other_ms(self) -> float:
        """`step_ms - attention_ms - ffn_ms - comm_ms`: embedding, LM head, sampling,
        scheduling; stays with the attention role under AFD."""
        return max(self.step_ms - self.attention_ms - self.ffn_ms - self.comm_ms, 0.0)


class PlainPoint(_Record):
    """One decode step of plain vLLM (the whole model in one engine) at equal resources:
    on CPU every host core as its threads, on CUDA one GPU."""

    batch: int = Field(ge=1)
    """Sequences decoding together."""
    context: float = Field(ge=0)
    """Mean context length of those sequences during the measured steps, tokens."""
    step_ms: float = Field(gt=0)
    """Wall time of one decode step (CPU: forward start to forward start in the engine;
    CUDA: the app's TPOT p50), ms."""


class ServingPoint(_Record):
    """Plain vLLM served through the Serve app at one batch, on the cores of `Profile.plain`:
    the product path (`afd_ray.bench`: HTTP through the Serve proxy, the `Ingress`
    replica, the engine's replica with vLLM's OpenAI layer, streamed to a client on the
    same machine), against which the engine's own step (`PlainPoint`) leaves out what
    serving costs per step (`afd_ray.plan.model`: T_serve)."""

    batch: int = Field(ge=1)
    """Concurrent streams (the decode batch)."""
    context: float = Field(ge=0)
    """Mean context of those sequences during decode (prompt + half the output), tokens."""
    tpot_ms: float = Field(gt=0)
    """TPOT p50 the client measured (first token to last over the tokens between), ms."""
    load_average_1m: float = Field(ge=0)
    """The machine's 1-minute load average when the load started (how busy it was)."""


class Link(_Record):
    """The A2F/F2A link: `time(message of n bytes) = latency + n / bandwidth`."""

    latency_us: float = Field(ge=0)
    """Fixed cost of one message (one direction, one layer), microseconds."""
    bandwidth_gbps: float = Field(gt=0)
    """Bytes per second of one direction, 10^9."""
    source: str
    """How it was measured."""


class Verdict(_Record):
    """Whether AFD pays at one batch size against plain vLLM given the same resources:
    AFD 1A:1F against plain vLLM on the cores (CPU) or GPUs those two ranks use."""

    batch: int
    """Sequences per attention rank (and per plain engine)."""
    ffn_share: float
    """`ffn_ms / step_ms` of the profiled step."""
    bytes_per_step: float
    """The AFD traffic per step (docs/models.md), A2F + F2A bytes: `2 × L × batch × H × bytes_per_elem`."""
    transfer_ms: float
    """Those bytes over the link, with its latency per message (`2 × L` messages)."""
    afd_tpot_ms: float
    """Predicted TPOT of AFD 1A:1F (`afd_ray.plan.model`)."""
    plain_tpot_ms: float
    """TPOT of plain vLLM at equal resources: measured (CPU), or the DP+EP model over 2 GPUs (CUDA)."""
    afd_over_plain: float
    """AFD's output tok/s per core or GPU over plain vLLM's at this batch."""
    can_pay: bool
    """`afd_over_plain > 1`."""
    reason: str


class Profile(_Record):
    """What `afd-ray plan` needs about one model on one kind of device."""

    model: str
    device: str
    """Where it was measured (CPU model and threads, or the GPU's name)."""
    source: str
    """Which tool measured it."""
    platform: Literal["cpu", "cuda"] = "cpu"
    """`cpu`: ranks share the host's cores; `cuda`: one GPU per rank (or a fraction of one)."""
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    bytes_per_elem: int = Field(ge=1)
    moe: bool
    """Routed experts: FFN ranks then shard them (EP) and split the FFN's weight reads."""
    points: list[StepPoint] = Field(min_length=1)
    plain: list[PlainPoint] = Field(min_length=1)
    """Plain vLLM's decode steps at equal resources (see `PlainPoint`)."""
    plain_devices: float = Field(gt=0)
    """Cores (CPU: its threads) or GPUs the plain engine of `plain` ran on."""
    link: Link
    serving: list[ServingPoint] = []
    """CPU: plain vLLM through the Serve app at two or more batches (`ServingPoint`),
    for what serving adds to every step; empty: not measured (`afd-ray profile
    --no-serving`, a checkpoint folder the benchmark cannot serve by name, or CUDA,
    whose points are measured through the app already), and the model adds nothing."""
    verdicts: list[Verdict] = []
