"""`model.load_format: dummy` on the FFN role: `load_ffn_stack(random_weights=True)`
builds a model from its `config.json` alone (no safetensors), with seeded random
weights at a scale that keeps activations finite and O(1)."""

from __future__ import annotations

from pathlib import Path

import torch

from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.moe import MoE
from afd_ray.models.tiny import tiny_config

CPU = torch.device("cpu")


def test_config_json_alone_gives_a_seeded_random_stack(tmp_path: Path) -> None:
    tiny_config("deepseek_v3").save_pretrained(tmp_path)  # config.json only
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    stack = load_ffn_stack(tmp_path, torch.float32, CPU, random_weights=True)
    again = load_ffn_stack(tmp_path, torch.float32, CPU, random_weights=True)
    shard = load_ffn_stack(tmp_path, torch.float32, CPU, ep_rank=1, ep_size=2, random_weights=True)
    assert stack.loaded_bytes == 0
    tensors, shard_tensors = stack.checkpoint_tensors(), shard.checkpoint_tensors()
    for key, tensor in tensors.items():
        assert torch.equal(tensor, again.checkpoint_tensors()[key]), key  # seeded by name
        if key in shard_tensors:  # an EP shard holds the same values for what it owns
            assert torch.equal(tensor, shard_tensors[key]), key
        if tensor.dim() >= 2:
            assert 0.5 < float(tensor.std() * tensor.shape[-1] ** 0.5) < 2.0, key  # N(0, 1/fan_in)
    hidden = torch.randn(5, stack.hidden_size)
    with torch.inference_mode():
        for layer in range(stack.num_layers):
            out = stack(layer, hidden)
            assert out.shape == hidden.shape and torch.isfinite(out).all()
            assert 0.05 < float(out.std()) < 20
    assert any(isinstance(block, MoE) for block in stack.layers)
