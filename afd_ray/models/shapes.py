"""Benchmark model shapes: folders with a real model's `config.json` and a tokenizer
covering its whole vocabulary, and no weights.

Served with `ModelConfig.load_format: dummy` (random weights on both roles), they run
at the real model's size and speed without a download: the H200 product benchmark
(`python -m afd_ray.bench --platform cuda --families deepseek-v2-lite`).

- `deepseek-v2-lite`: DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite, config.json):
  27 layers, H = 2048, MLA (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, 16
  heads, no q LoRA), layer 0 dense (I = 10944), then 64 routed experts (I = 1408,
  top-6, greedy softmax routing) + 2 shared, vocab 102400. Left out: its YaRN rope
  scaling (plain rope here; the same kernels and sizes at contexts <= 8K).
- `qwen3-30b-a3b`: Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, config.json): 48 layers,
  H = 2048, GQA 32 query / 4 KV heads of 128, 128 experts (I = 768, top-8,
  normalized), vocab 151936.

The tokenizer is a word-level one, `t<id>` for every id (ids 0 and 1 are `<s>` and
`</s>`), so any generated id detokenizes; prompts are sent as token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from afd_ray.models._folder import build_once

__all__ = ["SHAPES", "Shape", "build_shape", "shape_config"]

Shape = Literal["deepseek-v2-lite", "qwen3-30b-a3b"]
SHAPES: tuple[Shape, ...] = get_args(Shape)

BOS, EOS = "<s>", "</s>"  # ids 0 and 1


def shape_config(shape: Shape, num_hidden_layers: int | None = None):  # -> PreTrainedConfig
    """The transformers config of `shape` (bfloat16); `num_hidden_layers` overrides
    the depth (tests on CPU).

    Raises:
        ValueError: unknown `shape`.
    """
    from transformers import DeepseekV2Config, Qwen3MoeConfig

    common = dict(
        hidden_size=2048,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
        max_position_embeddings=8192,
    )
    if shape == "deepseek-v2-lite":
        config = DeepseekV2Config(
            **common,
            vocab_size=102400,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=num_hidden_layers or 27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            routed_scaling_factor=1.0,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            v_head_dim=128,
            qk_nope_head_dim=128,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=False,
            rope_theta=10000.0,
        )
        config.scoring_func = "softmax"  # read by vLLM
        config.moe_layer_freq = 1
        config.architectures = ["DeepseekV2ForCausalLM"]  # vLLM picks its model class by this
        return config
    if shape == "qwen3-30b-a3b":
        config = Qwen3MoeConfig(
            **common,
            vocab_size=151936,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=num_hidden_layers or 48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rope_theta=1e6,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
        return config
    raise ValueError(f"unknown model shape {shape!r}; expected one of {SHAPES}")


def _tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {BOS: 0, EOS: 1} | {f"t{i}": i for i in range(2, vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def build_shape(shape: Shape, out_dir: Path, num_hidden_layers: int | None = None) -> Path:
    """Write `shape`'s `config.json` and tokenizer into `out_dir` (once) and return it.

    Raises:
        ValueError: unknown `shape`.
    """
    config = shape_config(shape, num_hidden_layers)

    def build(tmp: Path) -> None:
        config.save_pretrained(tmp)
        _tokenizer(config.vocab_size).save_pretrained(tmp)

    return build_once(Path(out_dir), build)
