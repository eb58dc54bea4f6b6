"""MoE routing: the gate of one layer, from hidden states to top-k experts and weights.

`Router` holds only the gate weights, so either role can run it: the FFN role by
default, the attention role with `gate_on_attention` (docs/models.md, gate placement).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from afd_ray.layers.fused_routing import fused_routing
from afd_ray.layers.spec import RoutingSpec

__all__ = ["Router", "Routing"]


class Routing(NamedTuple):
    """Top-k experts of each token, best first (by selection score)."""

    ids: torch.Tensor
    """`[T, k]` int64 expert ids in `[0, E)`."""
    weights: torch.Tensor
    """`[T, k]` float32 weight of each chosen expert's output."""


class Router(nn.Module):
    """The gate of one MoE layer: hidden `[T, H]` -> `Routing`.

    Parameters (FFN block names `gate.*`, e.g. `model.layers.{i}.mlp.gate.*`):
        weight: `[E, H]`; float32 when `spec.float32_logits`, else `dtype`.
        e_score_correction_bias: `[E]` float32 buffer, only with `spec.correction_bias`.

    Routing follows transformers 5.19 (`Qwen3MoeTopKRouter`, `DeepseekV2TopkRouter`,
    `DeepseekV3TopkRouter`) and vLLM's `grouped_topk`; DeepSeek-V3's
    auxiliary-loss-free bias is the DeepSeek-V3 technical report (arXiv:2412.19437,
    §2.1.2, eqs. 13-16):

        s = softmax(W h) or sigmoid(W h)      # [T, E] float32 (`float32_scores`) or logits dtype
        c = s + b (bias, selection only) or s
        groups: keep the `top_groups` groups of best group score of c, mask the rest
        ids = top-k of the masked c;  w = s[ids]
        w = w / (sum(w) + 1e-20) if renormalize;  w = w * scaling_factor
    """

    def __init__(self, spec: RoutingSpec, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        weight_dtype = torch.float32 if spec.float32_logits else dtype
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=weight_dtype), requires_grad=False)
        self.e_score_correction_bias: torch.Tensor | None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.empty(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, hidden: torch.Tensor) -> Routing:
        """Route hidden `[T, H]` (model dtype) to `Routing` (`[T, k]` int64, float32;
        computed in the logits' dtype unless `spec.float32_scores`).

        On CUDA, where vLLM has a fused top-k kernel for this routing
        (`afd_ray.layers.fused_routing`), that kernel computes it, as in plain vLLM;
        otherwise `route_logits` (torch)."""
        if self.spec.float32_logits:
            logits = F.linear(hidden.float(), self.weight)  # [T, E]
        else:
            logits = F.linear(hidden, self.weight)  # [T, E] model dtype
        fused = fused_routing(self.spec, hidden, logits, self.e_score_correction_bias)
        return self.route_logits(logits) if fused is None else Routing(*fused)

    def route_logits(self, logits: torch.Tensor) -> Routing:
        """The routing of gate logits `[T, E]` with torch operations (any device)."""
        spec = self.spec
        if spec.float32_scores:
            logits = logits.float()
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if spec.num_groups > 1:
            choice = self._limit_groups(choice)
        values, ids = choice.topk(spec.top_k, dim=-1)  # [T, k]
        # with a bias the choice is not the score: the weights are the unbiased scores
        weights = values if self.e_score_correction_bias is None else scores.gather(1, ids)  # [T, k]
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(ids, (weights * spec.scaling_factor).float())

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Set the scores of experts outside each token's best groups to -inf."""
        spec = self.spec
        grouped = choice.view(choice.shape[0], spec.num_groups, spec.num_experts // spec.num_groups)  # [T, G, E/G]
        if spec.group_score == "max":
            group_scores = grouped.amax(dim=-1)  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(spec.top_groups, dim=-1).indices  # [T, top_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)  # [T, E]
