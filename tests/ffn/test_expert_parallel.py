"""EP shards, simulated in one process: each loads only its experts, and their
partial outputs sum to the single-rank MoE."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.eplb.contiguous import owned_experts
from afd_ray.layers.moe import MoE
from afd_ray.weights import expert_of, ffn_layer_params

CPU = torch.device("cpu")
T = 50


def _resident_bytes(module: torch.nn.Module, experts: bool) -> int:
    """Bytes of the storages behind `module`'s tensors, routed experts or the rest."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for name, t in module.state_dict(keep_vars=True).items()
        if (".experts." in name) == experts
    }
    return sum(storages.values())


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v3_k3_unnormalized"])
@pytest.mark.parametrize("ep_size", [2, 3])
def test_shards_sum_to_single_rank(name, ep_size, checkpoint):
    folder = checkpoint(name)
    full = load_ffn_stack(folder, torch.float32, CPU)
    shards = [load_ffn_stack(folder, torch.float32, CPU, ep_rank=r, ep_size=ep_size) for r in range(ep_size)]
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i, block in enumerate(full.layers):
            x = torch.randn(T, full.hidden_size, generator=gen)
            if not isinstance(block, MoE):
                for shard in shards:
                    torch.testing.assert_close(shard(i, x), full(i, x), atol=0, rtol=0)
                continue
            parts = [shard.layers[i] for shard in shards]
            routing = parts[0].route(x)
            for part in parts[1:]:  # the gate is replicated
                assert torch.equal(part.route(x).ids, routing.ids)
                assert torch.equal(part.route(x).weights, routing.weights)
            k = routing.ids.shape[1]
            rows = x.repeat_interleave(k, dim=0)  # [T*k, H]
            ids, weights = routing.ids.flatten(), routing.weights.flatten()
            partial = torch.zeros_like(rows)
            for part in parts:
                out = part.experts(rows, ids, weights)  # [T*k, H]
                mine = torch.isin(ids, torch.tensor(part.experts.owned))
                assert torch.all(out[~mine] == 0)
                # A real EP dispatch sends an owner only its rows: same result.
                alone = part.experts(rows[mine], ids[mine], weights[mine])
                torch.testing.assert_close(alone, out[mine], atol=0, rtol=0)
                partial += out
            combined = partial.view(T, k, -1).sum(dim=1)  # [T, H]
            shared = parts[0].shared(x)
            if shared is not None:
                combined += shared
            torch.testing.assert_close(combined, full(i, x), atol=1e-6, rtol=1e-6)
            with pytest.raises(RuntimeError, match="needs all"):
                shards[0](i, x)


def test_empty_batch(checkpoint):
    """A rank with no tokens still runs every layer in an EP step."""
    shard = load_ffn_stack(checkpoint("deepseek_v3"), torch.bfloat16, CPU, ep_rank=1, ep_size=3)
    empty = torch.empty(0, shard.hidden_size, dtype=torch.bfloat16)
    routing = shard.layers[1].route(empty)
    assert routing.ids.shape == (0, 2)
    assert shard.layers[1].experts(empty, routing.ids.flatten(), routing.weights.flatten()).shape == (0, 128)
    assert shard(0, empty).shape == (0, 128)


def test_shard_materializes_only_owned_experts(checkpoint):
    folder = checkpoint("deepseek_v3")  # 8 experts; 3 ranks own 3, 3, 2
    full = load_ffn_stack(folder, torch.float32, CPU)
    full_experts, full_rest = _resident_bytes(full, True), _resident_bytes(full, False)
    per_expert = full_experts // 8
    for rank in range(3):
        owned = owned_experts(8, 3, rank)
        shard = load_ffn_stack(folder, torch.float32, CPU, ep_rank=rank, ep_size=3)
        assert _resident_bytes(shard, True) == per_expert * len(owned)
        assert _resident_bytes(shard, False) == full_rest  # gate, shared experts, dense MLP
        read = [(layer, name, t) for layer, name, t in ffn_layer_params(folder, shard.num_layers, owned)]
        read_experts = {expert_of(f"model.layers.{layer}.mlp.{name}") for layer, name, _ in read} - {None}
        assert read_experts == set(owned)
        assert sum(t.nbytes for layer, name, t in read if name.startswith("experts.")) == per_expert * len(owned)


def test_meta_construction_allocates_nothing(checkpoint):
    with torch.device("meta"):
        stack = FFNStack(AutoConfig.from_pretrained(checkpoint("qwen3_moe")), torch.bfloat16, ep_rank=1, ep_size=3)
    assert all(p.is_meta for p in stack.parameters())
    assert stack.layers[0].experts.gate_up.shape == (3, 2 * 64, 128)
