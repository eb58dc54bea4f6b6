"""What a checkpoint's FFN blocks look like: `FFNLayout`, `MoEShape`, `RoutingSpec`.

Plain frozen dataclasses, torch-free: `afd_ray.layers.family` reads them from each
family's config, and the layer modules (`mlp`, `routing`, `moe`) build from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["FFNLayout", "MoEShape", "RoutingSpec"]


@dataclass(frozen=True)
class RoutingSpec:
    """How one model family turns gate logits into top-k experts and weights.

    Raises:
        ValueError: the groups do not split the experts evenly, fewer than `top_k`
            experts remain after group limiting, or a `top2_sum` group has one expert.
    """

    num_experts: int
    """Routed experts per MoE layer (E)."""
    top_k: int
    """Experts chosen per token (k)."""
    scoring: Literal["softmax", "sigmoid"]
    """Logits -> scores: softmax over the experts, or an independent sigmoid each."""
    num_groups: int
    """Expert groups (G; experts `[g*E/G, (g+1)*E/G)` form group g); 1 = no group limit."""
    top_groups: int
    """Groups a token may choose from (the best `top_groups` by group score)."""
    group_score: Literal["max", "top2_sum"]
    """A group's score: its best expert score (DeepSeek-V2), or the sum of its best two
    (DeepSeek-V3)."""
    correction_bias: bool
    """Whether `e_score_correction_bias` is added to the scores for selection only."""
    renormalize: bool
    """Whether the k weights are divided by their sum (`norm_topk_prob`)."""
    scaling_factor: float
    """Multiplies the k weights last (`routed_scaling_factor`)."""
    float32_logits: bool
    """Whether the gate matmul runs in float32 (DeepSeek) or in the model dtype (Qwen3)."""
    float32_scores: bool = True
    """Whether the scores, the choice and the weights are computed from the logits in
    float32 (vLLM's fused top-k kernels: `topk_softmax` for Qwen3 and Mixtral, the
    fused grouped top-k for DeepSeek-V3), or in the logits' dtype (vLLM's
    `grouped_topk`, which DeepSeek-V2's router runs, vLLM 0.26 and 0.32:
    `torch.softmax` of the model-dtype logits, weights renormalized and scaled in that
    dtype, then cast to float32). In bfloat16 the two choose differently wherever
    scores round to ties: with tiny logits (vLLM's `load_format="dummy"`) every score
    rounds to 1/E, so vLLM sends every token to the same k experts."""

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups} groups")
        if self.top_k > self.top_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.top_groups} groups of "
                f"{self.num_experts // self.num_groups} experts a token may choose from"
            )
        if self.group_score == "top2_sum" and self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("group_score 'top2_sum' needs at least 2 experts per group")


@dataclass(frozen=True)
class MoEShape:
    """Sizes of an MoE layer's experts."""

    routing: RoutingSpec
    intermediate_size: int
    """Width of one routed expert (`moe_intermediate_size`)."""
    shared_intermediate_size: int
    """Width of the shared experts fused into one MLP (`moe_intermediate_size *
    n_shared_experts`); 0 = none."""

    def split_output(self, compiled: bool) -> bool:
        """Whether the FFN role returns this layer's output as its parts (F2A `[T, P,
        H]`, `output_parts`) instead of their sum (`[T, H]`), for attention engines
        that run torch.compile (`compiled`) or eager.

        Why: vLLM's MoE layer (`MoERunner.forward`, 0.26 and 0.32) returns the routed
        experts' output and the shared experts' output from its opaque fused-MoE op,
        each in the model dtype, then computes `routed * routed_scaling_factor +
        shared` as elementwise torch ops. Compiled, inductor fuses them into the next
        layer's residual add and RMSNorm, so that sum is never rounded to the model
        dtype; eager, every op rounds. A compiled AFD attention engine gets the same
        kernel by doing these ops itself after the FFN boundary
        (`afd_ray.attention.models.base.combine_moe_parts`). Only layers with such ops
        split: with shared experts or a routed scaling factor other than 1.
        """
        return compiled and (self.shared_intermediate_size > 0 or self.routing.scaling_factor != 1.0)

    @property
    def output_parts(self) -> int:
        """P of a split output `[T, P, H]`: the routed experts' output (routing
        weights not yet scaled), then, if the layer has them, the shared experts'."""
        return 2 if self.shared_intermediate_size else 1

    def routing_of(self, split_output: bool) -> RoutingSpec:
        """The routing that yields the routed part: with a split output the weights
        are not scaled (the attention side scales the output, as vLLM does)."""
        return replace(self.routing, scaling_factor=1.0) if split_output else self.routing


@dataclass(frozen=True)
class FFNLayout:
    """The FFN blocks of every decoder layer of one checkpoint."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    """Width of the dense MLP layers."""
    hidden_act: str
    mlp_bias: bool
    """Whether dense MLPs and shared experts have biases (routed experts never do)."""
    moe_layers: frozenset[int]
    """Layers whose FFN is an MoE; the others are dense MLPs."""
    moe: MoEShape | None
    """Sizes of the MoE layers; None for a dense model."""
