"""Weight ownership by name: MoE tensors are FFN-role, and which expert each belongs to."""

from __future__ import annotations

import pytest

from afd_ray.weights import Role, expert_of, ffn_block_name, ffn_layer_params, role_of

FFN_NAMES = {
    "model.layers.0.mlp.down_proj.weight": None,
    "model.layers.3.mlp.gate.weight": None,
    "model.layers.3.mlp.gate.e_score_correction_bias": None,
    "model.layers.3.mlp.experts.17.gate_proj.weight": 17,
    "model.layers.3.mlp.experts.0.down_proj.weight": 0,
    "model.layers.12.mlp.shared_experts.up_proj.weight": None,
    "model.layers.3.block_sparse_moe.gate.weight": None,
    "model.layers.3.block_sparse_moe.experts.7.w2.weight": 7,
}
MIXTRAL_BLOCK_NAMES = {
    "model.layers.3.block_sparse_moe.gate.weight": (3, "gate.weight"),
    "model.layers.3.block_sparse_moe.experts.7.w1.weight": (3, "experts.7.gate_proj.weight"),
    "model.layers.3.block_sparse_moe.experts.7.w3.weight": (3, "experts.7.up_proj.weight"),
    "model.layers.31.block_sparse_moe.experts.0.w2.weight": (31, "experts.0.down_proj.weight"),
}
ATTENTION_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.3.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize(("name", "expert"), FFN_NAMES.items())
def test_ffn_names(name, expert):
    assert role_of(name) is Role.FFN
    assert expert_of(name) == expert


@pytest.mark.parametrize("name", ATTENTION_NAMES)
def test_attention_names(name):
    assert role_of(name) is Role.ATTENTION
    assert expert_of(name) is None
    assert ffn_block_name(name) is None


def test_block_names_are_one_naming_for_every_family():
    for name, block in MIXTRAL_BLOCK_NAMES.items():
        assert ffn_block_name(name) == block
    for name in FFN_NAMES:
        if ".mlp." in name:  # already the FFN block naming
            layer, inner = name.removeprefix("model.layers.").split(".mlp.")
            assert ffn_block_name(name) == (int(layer), inner)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_saved_checkpoint_names(family, checkpoint):
    """What transformers 5.19's save_pretrained writes: one tensor per expert and projection."""
    names = {(layer, name) for layer, name, _ in ffn_layer_params(checkpoint(family))}
    moe_layer = 0 if family == "qwen3_moe" else 1
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert (moe_layer, f"experts.{e}.{proj}.weight") in names
    assert (moe_layer, "gate.weight") in names
    assert ((moe_layer, "gate.e_score_correction_bias") in names) == (family == "deepseek_v3")
    assert ((moe_layer, "shared_experts.down_proj.weight") in names) == family.startswith("deepseek")


def test_filters(checkpoint):
    folder = checkpoint("deepseek_v3")
    kept = [(layer, name) for layer, name, _ in ffn_layer_params(folder, num_layers=2, experts={1, 6})]
    assert {layer for layer, _ in kept} == {0, 1}
    assert {expert_of(f"model.layers.{layer}.mlp.{name}") for layer, name in kept} == {None, 1, 6}
    assert (1, "gate.weight") in kept and (1, "shared_experts.gate_proj.weight") in kept


def test_no_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError):
        next(ffn_layer_params(tmp_path))
