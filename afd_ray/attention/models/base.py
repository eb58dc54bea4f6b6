"""What every AFD attention-role model shares: the layer body around the FFN boundary,
the causal-LM plumbing, and the attention-role weight filter.

Gate placement reaches model code as one config attribute, `afd_gate_on_attention`
(set through vLLM's `hf_overrides`). With it, MoE layers route on the attention side
and call `remote_moe` with the top-k ids and weights, and dense MLP layers run
locally; otherwise every layer calls `remote_ffn`.

When the engine runs torch.compile (not `enforce_eager`), the piece after the FFN
boundary computes what a compiled plain vLLM engine fuses into the next layer's
residual add and RMSNorm (there one piece spans the FFN), so inductor fuses the same
float32 expression:
- an MoE layer whose output vLLM finishes with elementwise ops
  (`MoEShape.split_output`: shared experts, or a routed scaling factor) gets its
  parts from the FFN role and finishes them here, as vLLM's MoE layer does
  (`combine_moe_parts`);
- the residual is recomputed from the layer's attention output and incoming residual
  (`AFDDecoderLayer._post_attention`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.sequence import IntermediateTensors

from afd_ray.attention.ffn_op import attach_ffn_peer, begin_ffn_step, remote_ffn, remote_moe
from afd_ray.attention.model_state import AFDModelState
from afd_ray.layers.family import ffn_layout
from afd_ray.layers.mlp import GatedMLP
from afd_ray.layers.routing import Router
from afd_ray.weights import Role, ffn_block_prefix, role_of

__all__ = ["GATE_ON_ATTENTION", "AFDCausalLM", "AFDDecoderLayer", "attention_weights", "combine_moe_parts"]

GATE_ON_ATTENTION = "afd_gate_on_attention"
"""Config attribute (via `hf_overrides`) that selects `gate_on_attention`."""


def _gate_on_attention(config: PretrainedConfig) -> bool:
    return bool(getattr(config, GATE_ON_ATTENTION, False))


def attention_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The attention-role `(name, tensor)` pairs of a checkpoint stream (`role_of`
    under the model's gate placement)."""
    on_attention = _gate_on_attention(config)
    moe_layers = ffn_layout(config).moe_layers if on_attention else frozenset()
    return ((n, t) for n, t in weights if role_of(n, on_attention, moe_layers) is Role.ATTENTION)


def combine_moe_parts(parts: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    """An MoE layer's output from its split parts, computed as vLLM's MoE layer
    computes it after its fused-MoE op (`MoERunner.forward`:
    `_maybe_apply_routed_scale_to_output`, then `shared_output + fused_output`; vLLM
    0.26 and 0.32), op for op and in the same dtype, so that torch.compile fuses it
    the same way.

    Args:
        parts: `[T, P, H]` model dtype: `[:, 0]` the routed experts' output with
            unscaled routing weights, `[:, 1]` (P = 2) the shared experts' output.
        routed_scaling_factor: the config's `routed_scaling_factor`.

    Returns:
        `[T, H]`, model dtype: the routed part times the factor plus the shared part
        (float16 with shared experts: the routed part plus the shared part divided
        by the factor, vLLM's overflow guard).
    """
    routed = parts[:, 0]  # [T, H]
    shared = parts[:, 1] if parts.shape[1] == 2 else None  # [T, H]
    if routed_scaling_factor != 1.0:
        if routed.dtype != torch.float16 or shared is None:
            routed = routed * routed_scaling_factor
        else:
            shared = shared * (1.0 / routed_scaling_factor)
    return routed if shared is None else shared + routed


class _AttentionGate(nn.Module):
    """An MoE layer's router on the attention side, named like the checkpoint's
    `<block>.gate.*`."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.gate = router


class AFDDecoderLayer(nn.Module):
    """A decoder layer whose FFN half runs on the FFN pool.

    Subclasses build `self_attn`, `input_layernorm`, `post_attention_layernorm` (vLLM
    fused-residual RMSNorms), set `layer_idx` and call `_build_ffn_half`;
    `self_attn(positions=, hidden_states=)` maps `[T, H] -> [T, H]`.
    """

    layer_idx: int

    def _build_ffn_half(self, vllm_config: VllmConfig) -> None:
        """Whether this layer's FFN output comes split (`MoEShape.split_output`, the
        engine compiled unless `enforce_eager`); with `gate_on_attention`, this
        layer's router (MoE layer) or dense MLP, under the checkpoint's FFN block name
        (`mlp` / `block_sparse_moe`). Opens the worker's FFN client first (`attach_ffn_peer`)."""
        attach_ffn_peer(vllm_config)
        config = vllm_config.model_config.hf_config
        layout = ffn_layout(config)
        compiled = not vllm_config.model_config.enforce_eager
        split = self.layer_idx in layout.moe_layers and layout.moe.split_output(compiled)
        # P of this layer's split output `[T, P, H]`, or None: the FFN returns `[T, H]`.
        self._moe_parts: int | None = layout.moe.output_parts if split else None
        self._routed_scaling_factor = layout.moe.routing.scaling_factor if split else 1.0
        # The FFN boundary splits a compiled piece: recompute the residual after it.
        self._recompute_residual = compiled
        self._local_block: str | None = None
        if not _gate_on_attention(config):
            return
        dtype = vllm_config.model_config.dtype
        if self.layer_idx in layout.moe_layers:
            router = Router(layout.moe.routing_of(split), layout.hidden_size, dtype)
            block: nn.Module = _AttentionGate(router)
        else:
            block = GatedMLP(layout.hidden_size, layout.intermediate_size, layout.hidden_act, layout.mlp_bias, dtype)
            self._recompute_residual = False  # no FFN boundary: the piece spans the MLP
        self._local_block = ffn_block_prefix(config.model_type)
        setattr(self, self._local_block, block)

    def _ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's FFN of post-attention-norm `hidden` `[T, H]` -> `[T, H]`."""
        if self._local_block is None:
            out = remote_ffn(hidden, self.layer_idx, self._moe_parts)  # [T, H] or [T, P, H]
        else:
            block = getattr(self, self._local_block)
            if isinstance(block, GatedMLP):
                return block(hidden)
            routing = block.gate(hidden)  # ids [T, k] int64, weights [T, k] float32
            out = remote_moe(hidden, routing.ids, routing.weights, self.layer_idx, self._moe_parts)
        if self._moe_parts is None:
            return out
        return combine_moe_parts(out, self._routed_scaling_factor)

    def _post_attention(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`post_attention_layernorm`, then the FFN: the attention output and the
        incoming residual `[T, H]` -> (FFN output `[T, H]`, residual for the next
        layer `[T, H]`).

        Compiled (not `enforce_eager`) and across the FFN boundary, the residual is
        recomputed after the boundary from the two tensors it sums, as vLLM's native
        fused-add RMSNorm computes it: a compiled plain engine has this norm and the
        next layer's in one piece, where inductor computes `attention + residual` in
        float32 inside the next norm's kernel and drops its rounding to the model
        dtype (the `.to(dtype)` then `.to(float32)` of the native op); the boundary
        ends the piece, and the next one would read the rounded residual instead.
        """
        if not self._recompute_residual:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self._ffn(hidden_states), residual
        # Copies: the norm may update its inputs in place (vLLM IR `maybe_inplace`).
        attention, incoming = hidden_states.clone(), residual.clone()  # [T, H] each
        hidden_states, _ = self.post_attention_layernorm(hidden_states, residual)
        out = self._ffn(hidden_states)
        return out, (attention.float() + incoming.float()).to(attention.dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states, residual: `[T, H]` -> (FFN output `[T, H]`, residual `[T, H]`)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        return self._post_attention(hidden_states, residual)


class AFDCausalLM(nn.Module):
    """vLLM causal-LM plumbing over `self.model` (embeddings, layers, norm), `self.lm_head`,
    `self.logits_processor` and `self.config`, loading attention-role tensors only."""

    @staticmethod
    def get_model_state_cls() -> type[AFDModelState]:
        """vLLM's per-model runner state (model runner V2): announces whole-step graph replays."""
        return AFDModelState

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        begin_ffn_step(positions.shape[-1])  # positions: [T] ([3, T] with M-RoPE)
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load attention-role tensors only; FFN-role tensors are skipped unread."""
        return AutoWeightsLoader(self).load_weights(attention_weights(weights, self.config))
