"""Upcycling a dense Llama into Mixtral, and the embedded `smollm2-moe` built that way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from afd_ray.models.embedded import (
    SMOLLM2_DIR,
    SMOLLM2_MOE_DIR,
    SMOLLM2_MOE_EXPERTS,
    SMOLLM2_MOE_TOP_K,
    cache_dir,
    prepare_smollm2_moe,
    upcycle_to_mixtral,
)

PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def test_upcycled_experts_are_the_dense_mlp(tiny_dir, tmp_path: Path) -> None:
    dense_dir = tiny_dir("llama")
    runs = {name: tmp_path / name for name in ("a", "b", "seed1")}
    for name, out in runs.items():
        out.mkdir()
        upcycle_to_mixtral(dense_dir, out, num_experts=3, top_k=2, seed=1 if name == "seed1" else 0)
    dense = load_file(dense_dir / "model.safetensors")
    moe = load_file(runs["a"] / "model.safetensors")
    config = AutoConfig.from_pretrained(runs["a"])
    assert (config.model_type, config.architectures) == ("mixtral", ["MixtralForCausalLM"])
    assert (config.num_local_experts, config.num_experts_per_tok) == (3, 2)
    assert config.hidden_size == 128 and config.num_hidden_layers == 2
    expected = {name for name in dense if ".mlp." not in name}
    for layer in range(2):
        expected.add(f"model.layers.{layer}.block_sparse_moe.gate.weight")
        assert moe[f"model.layers.{layer}.block_sparse_moe.gate.weight"].shape == (3, 128)
        for proj, w in PROJ.items():
            mlp = dense[f"model.layers.{layer}.mlp.{proj}.weight"]
            for e in range(3):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                assert torch.equal(moe[name], mlp), name
                expected.add(name)
    assert set(moe) == expected
    for name in dense.keys() & moe.keys():
        assert torch.equal(moe[name], dense[name]), name
    assert (runs["a"] / "model.safetensors").read_bytes() == (runs["b"] / "model.safetensors").read_bytes()
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    assert not torch.equal(load_file(runs["seed1"] / "model.safetensors")[gate], moe[gate])
    for path in dense_dir.iterdir():  # tokenizer and the like are copied
        if path.name != "config.json" and path.suffix != ".safetensors":
            assert (runs["a"] / path.name).read_bytes() == path.read_bytes(), path.name


def test_upcycle_refuses_what_it_cannot_copy(tiny_dir, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Llama"):
        upcycle_to_mixtral(tiny_dir("qwen3_moe"), tmp_path, num_experts=4, top_k=2, seed=0)
    with pytest.raises(ValueError, match="top_k"):
        upcycle_to_mixtral(tiny_dir("llama"), tmp_path, num_experts=2, top_k=3, seed=0)


def test_prepare_smollm2_moe_is_idempotent() -> None:
    folder = prepare_smollm2_moe()
    assert folder == cache_dir() / "models" / SMOLLM2_MOE_DIR
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_smollm2_moe() == folder
    assert weights.stat().st_mtime_ns == before
    assert not list(folder.parent.glob(f".{SMOLLM2_MOE_DIR}-*"))  # no temp leftovers
    config = AutoConfig.from_pretrained(folder)
    assert (config.num_local_experts, config.num_experts_per_tok) == (SMOLLM2_MOE_EXPERTS, SMOLLM2_MOE_TOP_K)
    assert config.dtype == torch.float32
    dense = cache_dir() / "models" / SMOLLM2_DIR
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (folder / name).read_bytes() == (dense / name).read_bytes(), name
