"""Benchmark model shapes: a real model's config.json and a tokenizer covering its
vocabulary, no weights (`afd_ray.models.shapes`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from afd_ray.models.shapes import SHAPES, build_shape, shape_config

EXPECTED = {  # from the models' own config.json on the Hugging Face hub
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        num_hidden_layers=27,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        topk_method="greedy",
        scoring_func="softmax",
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        num_key_value_heads=4,
        head_dim=128,
    ),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_config_is_the_real_models(shape: str) -> None:
    config = shape_config(shape)
    assert {key: getattr(config, key) for key in EXPECTED[shape]} == EXPECTED[shape]
    assert config.architectures == [
        {"deepseek-v2-lite": "DeepseekV2ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}[shape]
    ]


def test_shape_folder_has_the_config_and_a_full_vocab_tokenizer(tmp_path: Path) -> None:
    """One shape (about 10 s: a 102400-word tokenizer); the other builds the same way."""
    folder = build_shape("deepseek-v2-lite", tmp_path / "shape", num_hidden_layers=2)
    assert not list(folder.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(folder)
    expected = EXPECTED["deepseek-v2-lite"] | {"num_hidden_layers": 2}
    assert {key: getattr(config, key) for key in expected} == expected
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == config.vocab_size
    last = config.vocab_size - 1
    assert tokenizer.decode([5, last]) == f"t5 t{last}"  # every id the model can emit decodes
    assert tokenizer("t7 t9").input_ids == [7, 9]


def test_unknown_shape_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama-70b"):
        build_shape("llama-70b", tmp_path)  # type: ignore[arg-type]
