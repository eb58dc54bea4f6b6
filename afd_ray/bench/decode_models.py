"""Model shapes and the attention stage of the GPU decode benchmark (random weights).

The GPU machine has no vLLM, so the attention role of the decode benchmark
(`afd_ray.bench.decode`) is this module: embedding, per layer the input norm, the
attention projections, attention over a static KV cache of `context` positions, the
output projection, the residual add and the post-attention norm (the A2F tensor), then
the final norm and the LM head with a greedy argmax. The FFN role is the project's own
`afd_ray.ffn.model.FFNStack`, built from a transformers config of the same model.

Two attention kinds, as in the models they stand for:
- `mla` (DeepSeek-V2): multi-head latent attention in its absorbed form, as vLLM's MLA
  decode runs it (DeepSeek-V2 paper, arXiv:2405.04434, §2.1.2-2.1.3): the cache holds
  per position the normalized latent `c` `[r]` and the shared rope key `[d_rope]`;
  `q_nope` is multiplied by `W_UK` into latent space, scores are `[q_lat, q_rope] ·
  [c, k_rope]`, the output is `softmax · c` multiplied by `W_UV`. All batched matmuls.
- `gqa` (Qwen3-MoE): grouped-query attention with per-head q/k RMSNorm, through
  `torch.nn.functional.scaled_dot_product_attention` with the `g = heads/kv_heads`
  queries of each KV head as a query sequence of length g (no KV expansion).

The KV cache is static: every step attends over all `context` positions, and writes
its new entry at the last one. Rotary embedding is applied at that position. When the
cache of every layer does not fit in `kv_budget_bytes`, layers share `kv_layers` < L
buffers (layer ℓ uses buffer ℓ mod `kv_layers`); bytes read per step are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV2Config, PretrainedConfig, Qwen3MoeConfig

__all__ = ["MODELS", "AttentionShape", "AttentionStage", "ModelSpec", "init_random_"]

_EPS = 1e-6


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of the attention role of one model."""

    kind: Literal["mla", "gqa"]
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    """gqa: KV heads; mla: 1 (one latent per position)."""
    head_dim: int
    """gqa: q/k/v head size; mla: `qk_nope_head_dim`."""
    kv_lora_rank: int = 0
    """mla: latent size r."""
    rope_dim: int = 0
    """mla: `qk_rope_head_dim`; gqa: unused (rope over the whole head)."""
    v_head_dim: int = 0
    """mla: value head size."""

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """KV-cache bytes of one position of one layer."""
        size = torch.empty((), dtype=dtype).element_size()
        if self.kind == "mla":
            return (self.kv_lora_rank + self.rope_dim) * size
        return 2 * self.num_kv_heads * self.head_dim * size


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: its attention shape and its FFN role's transformers config."""

    name: str
    attention: AttentionShape
    ffn_config: PretrainedConfig


def _deepseek_v2_lite(tiny: bool) -> ModelSpec:
    """DeepSeek-V2-Lite shapes (config.json of deepseek-ai/DeepSeek-V2-Lite)."""
    h, layers, experts, inter, dense, vocab = (
        (64, 3, 8, 32, 96, 256) if tiny else (2048, 27, 64, 1408, 10944, 102400)
    )
    heads, nope, rope, rank, v = (4, 16, 8, 32, 16) if tiny else (16, 128, 64, 512, 128)
    config = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=dense,
        moe_intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=2,
        n_routed_experts=experts,
        num_experts_per_tok=2 if tiny else 6,
        first_k_dense_replace=1,
        kv_lora_rank=rank,
        q_lora_rank=None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        hidden_act="silu",
    )
    shape = AttentionShape("mla", h, layers, vocab, heads, 1, nope, rank, rope, v)
    return ModelSpec("deepseek-v2-lite-like", shape, config)


def _qwen3_30b_a3b(tiny: bool) -> ModelSpec:
    """Qwen3-30B-A3B shapes (config.json of Qwen/Qwen3-30B-A3B)."""
    h, layers, experts, inter, vocab = (64, 3, 8, 32, 256) if tiny else (2048, 48, 128, 768, 151936)
    heads, kv_heads, head_dim = (8, 2, 16) if tiny else (32, 4, 128)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=3 * inter,
        moe_intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=2 if tiny else 8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        hidden_act="silu",
    )
    shape = AttentionShape("gqa", h, layers, vocab, heads, kv_heads, head_dim)
    return ModelSpec("qwen3-30b-a3b-like", shape, config)


MODELS = {"deepseek-v2-lite": _deepseek_v2_lite, "qwen3-30b-a3b": _qwen3_30b_a3b}
"""Benchmark models by CLI name: `MODELS[name](tiny)` -> `ModelSpec` (tiny: CPU-test sizes)."""


def init_random_(module: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Fill every parameter and float buffer of `module` in place: 1-D tensors (norms,
    biases) with ones, others from N(0, std²), drawn from `generator` (random data,
    never zeros, so timings see real values)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, std, generator=generator)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, _EPS)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (neox layout) of `x` `[..., d]` at one position; cos, sin `[d/2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class AttentionStage(nn.Module):
    """The attention role of one model for decode steps of up to `max_batch` sequences.

    Args:
        shape: the model's attention sizes.
        dtype: model dtype (bf16 on GPU).
        device: where weights, KV cache and step state live.
        max_batch: largest decode batch (rows of the KV cache and of the state).
        context: positions per sequence in the static KV cache.
        kv_budget_bytes: most bytes the KV buffers may take (see module docstring).
        generator: source of the random weights and cache contents.

    Raises:
        ValueError: not even one layer's KV cache fits in `kv_budget_bytes`.
    """

    def __init__(
        self,
        shape: AttentionShape,
        dtype: torch.dtype,
        device: torch.device,
        max_batch: int,
        context: int,
        kv_budget_bytes: int,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.context = context
        h, heads, layers = shape.hidden_size, shape.num_heads, shape.num_layers
        per_layer = shape.kv_bytes_per_token_layer(dtype) * max_batch * context
        self.kv_layers = min(layers, kv_budget_bytes // per_layer)
        if self.kv_layers < 1:
            raise ValueError(
                f"kv_budget_bytes {kv_budget_bytes} holds no layer's KV cache ({per_layer} bytes)"
            )

        def weight(*size: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

        self.embed = weight(shape.vocab_size, h)
        self.lm_head = weight(shape.vocab_size, h)
        self.final_norm = weight(h)
        self.input_norm = weight(layers, h)
        self.post_norm = weight(layers, h)
        if shape.kind == "mla":
            nope, rope, rank, v = shape.head_dim, shape.rope_dim, shape.kv_lora_rank, shape.v_head_dim
            self.q_proj = weight(layers, heads * (nope + rope), h)
            self.kv_a_proj = weight(layers, rank + rope, h)
            self.kv_a_norm = weight(layers, rank)
            self.w_uk = weight(layers, heads, nope, rank)
            self.w_uv = weight(layers, heads, rank, v)
            self.o_proj = weight(layers, h, heads * v)
            self.scale = (nope + rope) ** -0.5
            rot = rope
            kv = torch.empty(self.kv_layers, max_batch, context, rank + rope, dtype=dtype, device=device)
            self.register_buffer("kv", kv)
        else:
            hd, kvh = shape.head_dim, shape.num_kv_heads
            self.qkv_proj = weight(layers, (heads + 2 * kvh) * hd, h)
            self.q_norm = weight(layers, hd)
            self.k_norm = weight(layers, hd)
            self.o_proj = weight(layers, h, heads * hd)
            rot = hd
            for name in ("k_cache", "v_cache"):
                self.register_buffer(
                    name, torch.empty(self.kv_layers, max_batch, kvh, context, hd, dtype=dtype, device=device)
                )
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
            for cache in self.buffers():
                cache.normal_(0.0, 1.0, generator=generator)
        pos = context - 1
        inv_freq = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot)  # [rot/2]
        self.register_buffer("cos", torch.cos(pos * inv_freq).to(dtype), persistent=False)
        self.register_buffer("sin", torch.sin(pos * inv_freq).to(dtype), persistent=False)

    def kv_bytes(self) -> int:
        """Bytes of the KV buffers."""
        return sum(
            b.numel() * b.element_size()
            for name, b in self.named_buffers()
            if name in ("kv", "k_cache", "v_cache")
        )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids `[B]` int64 -> hidden `[B, H]`."""
        return F.embedding(tokens, self.embed)

    def logits_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head, greedy choice: hidden `[B, H]` -> next token ids `[B]` int64."""
        return F.linear(_rms_norm(hidden, self.final_norm), self.lm_head).argmax(dim=-1)

    def attend(self, layer: int, residual: torch.Tensor, rows: slice) -> torch.Tensor:
        """Attention half of decoder layer `layer` for batch rows `rows`.

        Args:
            residual: `[T, H]` the residual stream of those rows; updated in place with
                the attention output.
            rows: the rows' place in the KV cache (their sequences).

        Returns:
            `[T, H]` the post-attention-norm hidden states (the A2F tensor).
        """
        x = _rms_norm(residual, self.input_norm[layer])
        out = self._mla(layer, x, rows) if self.shape.kind == "mla" else self._gqa(layer, x, rows)
        residual += out
        return _rms_norm(residual, self.post_norm[layer])

    def _mla(self, layer: int, x: torch.Tensor, rows: slice) -> torch.Tensor:
        s = self.shape
        tokens, heads, nope, rank = x.shape[0], s.num_heads, s.head_dim, s.kv_lora_rank
        q = F.linear(x, self.q_proj[layer]).view(tokens, heads, nope + s.rope_dim)  # [T, nh, nope+rope]
        q_nope, q_rope = q.split((nope, s.rope_dim), dim=-1)
        latent, k_rope = F.linear(x, self.kv_a_proj[layer]).split(
            (rank, s.rope_dim), dim=-1
        )  # [T, r], [T, rope]
        cache = self.kv[layer % self.kv_layers, rows]  # [T, S, r+rope]
        cache[:, -1] = torch.cat(
            (_rms_norm(latent, self.kv_a_norm[layer]), _rotate(k_rope, self.cos, self.sin)), -1
        )
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk[layer]).transpose(0, 1)  # [T, nh, r]
        q_full = torch.cat((q_lat, _rotate(q_rope, self.cos, self.sin)), dim=-1)  # [T, nh, r+rope]
        scores = torch.bmm(q_full, cache.transpose(1, 2))  # [T, nh, S]
        probs = torch.softmax(scores.float() * self.scale, dim=-1).to(x.dtype)
        o_lat = torch.bmm(probs, cache[..., :rank])  # [T, nh, r]
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv[layer]).transpose(0, 1)  # [T, nh, v]
        return F.linear(o.reshape(tokens, heads * s.v_head_dim), self.o_proj[layer])

    def _gqa(self, layer: int, x: torch.Tensor, rows: slice) -> torch.Tensor:
        s = self.shape
        tokens, heads, kvh, hd = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        q, k, v = F.linear(x, self.qkv_proj[layer]).split((heads * hd, kvh * hd, kvh * hd), dim=-1)
        q = _rotate(
            _rms_norm(q.view(tokens, heads, hd), self.q_norm[layer]), self.cos, self.sin
        )  # [T, nh, hd]
        k = _rotate(
            _rms_norm(k.view(tokens, kvh, hd), self.k_norm[layer]), self.cos, self.sin
        )  # [T, kvh, hd]
        k_cache = self.k_cache[layer % self.kv_layers, rows]  # [T, kvh, S, hd]
        v_cache = self.v_cache[layer % self.kv_layers, rows]
        k_cache[:, :, -1] = k
        v_cache[:, :, -1] = v.view(tokens, kvh, hd)
        q = q.view(tokens, kvh, heads // kvh, hd)  # the g queries of each KV head as a sequence
        o = F.scaled_dot_product_attention(q, k_cache, v_cache)  # [T, kvh, g, hd]
        return F.linear(o.reshape(tokens, heads * hd), self.o_proj[layer])
