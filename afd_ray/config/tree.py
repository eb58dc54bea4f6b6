"""`AFDConfig`: the root of the config tree and its cross-section checks."""

from __future__ import annotations

import math

from pydantic import model_validator

from afd_ray.config.base import GatePlacement, Section
from afd_ray.config.model import ModelConfig
from afd_ray.config.pools import AttentionPoolConfig, FFNPoolConfig
from afd_ray.config.serving import AutoscaleConfig, ConnectorConfig, IngressConfig, ObservabilityConfig
from afd_ray.connector.transports import check_transport
from afd_ray.platform import Platform, collective_backend

__all__ = ["FP8_PLATFORMS", "AFDConfig"]

FP8_PLATFORMS = ("cuda",)
"""Platforms with vLLM FP8 kernels for both roles (`model.quantization: fp8`, or an FP8
checkpoint: `ModelConfig.checkpoint_fp8`); the GPU
must also have compute capability >= 8.9 (`afd_ray.serve.check.FP8_CAPABILITY`)."""


class AFDConfig(Section):
    """Root of the config tree: the `args` of `deployments/afd.yaml`."""

    platform: Platform = "cpu"
    """Device family of both pools; fixes the torch device, the collective backend
    (gloo/nccl/hccl) and the Ray resource key (CPU/GPU/NPU)."""

    gate_placement: GatePlacement = "gate_on_ffn"
    """Where MoE routing runs (docs/models.md, gate placement). `gate_on_ffn`: the FFN receives hidden
    states and routes them. `gate_on_attention`: the attention rank computes the
    top-k ids and weights and sends them with the hidden states, and dense MLP layers
    stay on the attention rank (MoE models only)."""

    model: ModelConfig = ModelConfig()
    ingress: IngressConfig = IngressConfig()
    attention: AttentionPoolConfig = AttentionPoolConfig()
    ffn: FFNPoolConfig = FFNPoolConfig()
    connector: ConnectorConfig = ConnectorConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    observability: ObservabilityConfig = ObservabilityConfig()

    @model_validator(mode="after")
    def _bounds(self) -> AFDConfig:
        for name, pool in (("attention", self.attention), ("ffn", self.ffn)):
            if not pool.min_ranks <= pool.num_ranks:
                raise ValueError(f"{name}.min_ranks: {pool.min_ranks} > {name}.num_ranks {pool.num_ranks}")
            if pool.upper < pool.num_ranks:
                raise ValueError(f"{name}.max_ranks: {pool.max_ranks} < {name}.num_ranks {pool.num_ranks}")
        peers = math.ceil(self.attention.upper / self.ffn.min_ranks)  # most attention peers of one FFN rank
        if self.ffn.ubatches > peers:
            raise ValueError(
                f"ffn.ubatches: {self.ffn.ubatches} > {peers}, the most attention peers one FFN rank can have "
                f"(attention.max_ranks {self.attention.upper} / ffn.min_ranks {self.ffn.min_ranks}, rounded up); "
                "a step's peers are split into at most that many ubatches"
            )
        if self.ffn.ep_idle_max_check_us / 1e6 >= self.connector.timeout_s:
            raise ValueError(
                f"ffn.ep_idle_max_check_us: {self.ffn.ep_idle_max_check_us} us must be shorter than "
                f"connector.timeout_s {self.connector.timeout_s} s, the EP group's collective timeout: a busy rank "
                "waits that long for an idle one to check in"
            )
        if self.connector.transport != "auto":
            check_transport(self.connector.transport, collective_backend(self.platform))
        capacity = self.attention.upper * (self.attention.max_num_seqs + self.ingress.max_queued_per_rank)
        if self.ingress.max_ongoing_requests <= capacity:
            raise ValueError(
                f"ingress.max_ongoing_requests: {self.ingress.max_ongoing_requests} must exceed the admission "
                f"capacity {capacity} (attention.max_ranks x (attention.max_num_seqs + ingress.max_queued_per_rank))"
            )
        if self.model.fp8 and self.platform not in FP8_PLATFORMS:
            what = (
                f"model.quantization: {self.model.quantization}"
                if self.model.quantization is not None
                else f"model.source: {self.model.source!r} is an FP8 checkpoint and"
            )
            raise ValueError(
                f"{what} needs FP8 kernels, which afd_ray runs on "
                f"platform {' or '.join(FP8_PLATFORMS)} (compute capability >= 8.9) only, not {self.platform}"
            )
        if self.autoscale.enabled and self.autoscale.policy is None:
            raise ValueError("autoscale.policy: a policy file is needed when autoscale.enabled is true")
        return self

    @model_validator(mode="after")
    def _fp8_checkpoint_gate(self) -> AFDConfig:
        """With `gate_on_attention` the attention role runs the dense MLPs as afd_ray's
        model-dtype `GatedMLP` (`afd_ray.attention.models.base`), which do not read an FP8
        checkpoint's FP8 linears and scales."""
        if self.gate_placement == "gate_on_attention" and self.model.checkpoint_fp8 is not None:
            raise ValueError(
                f"gate_placement: gate_on_attention with {self.model.source!r}, an FP8 checkpoint: the attention "
                "role's dense MLPs load model-dtype weights only; use gate_on_ffn"
            )
        return self
