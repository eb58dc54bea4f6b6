"""The FFN stack on the embedded upcycled Mixtral (`smollm2-moe`, in the real cache).

Oracles: transformers 5.19's Mixtral MoE blocks (`model.layers[i].mlp`) for routing
and output, and SmolLM2's dense MLPs, which the upcycled MoE reproduces up to float
rounding because its experts are copies of the MLP and its top-2 weights sum to 1. The
experts being identical, the outputs cannot reveal a wrong expert choice: the routing
is compared with transformers' own router separately.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.embedded import SMOLLM2_MOE_EXPERTS, prepare_smollm2, prepare_smollm2_moe

CPU = torch.device("cpu")
T = 64


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return prepare_smollm2_moe()


def _inputs(num_layers: int, hidden_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(T, hidden_size, generator=gen) for _ in range(num_layers)]


def test_matches_transformers_mixtral_and_the_dense_mlp(moe_dir, reference_model):
    ref = reference_model(moe_dir, torch.float32)
    stack = load_ffn_stack(moe_dir, torch.float32, CPU)
    dense = load_ffn_stack(prepare_smollm2(), torch.float32, CPU)
    assert stack.num_layers == dense.num_layers == ref.config.num_hidden_layers == 30
    with torch.no_grad():
        for i, x in enumerate(_inputs(stack.num_layers, stack.hidden_size)):
            block, mlp = stack.layers[i], ref.model.layers[i].mlp
            assert isinstance(block, MoE) and len(block.experts.owned) == SMOLLM2_MOE_EXPERTS
            routing = block.route(x)
            _, ref_weights, ref_ids = mlp.gate(x)
            ids, order = routing.ids.sort(dim=-1)
            ref_sorted, ref_order = ref_ids.sort(dim=-1)
            assert torch.equal(ids, ref_sorted), f"layer {i}"
            torch.testing.assert_close(routing.weights.gather(1, order), ref_weights.gather(1, ref_order))
            # Tokens spread over every expert, hence over both EP2 ranks' halves.
            assert torch.bincount(routing.ids.flatten(), minlength=SMOLLM2_MOE_EXPERTS).min() > 0, f"layer {i}"
            out = stack(i, x)
            torch.testing.assert_close(out, mlp(x[None])[0], atol=1e-5, rtol=1e-5)
            mlp_out = dense(i, x)
            assert (out - mlp_out).norm() <= 1e-6 * mlp_out.norm(), f"layer {i}"


def test_ep2_shards_read_their_experts_and_sum_to_the_full_moe(moe_dir):
    full = load_ffn_stack(moe_dir, torch.float32, CPU)
    shards = [load_ffn_stack(moe_dir, torch.float32, CPU, ep_rank=r, ep_size=2) for r in range(2)]
    assert [shard.layers[0].experts.owned for shard in shards] == [(0, 1), (2, 3)]
    with torch.no_grad():
        for i, x in enumerate(_inputs(full.num_layers, full.hidden_size)):
            routing = full.layers[i].route(x)
            rows = x.repeat_interleave(2, dim=0)  # [T*2, H]; row t*2+j is token t's j-th expert
            ids, weights = routing.ids.flatten(), routing.weights.flatten()
            combined = sum(shard.layers[i].experts(rows, ids, weights) for shard in shards)  # [T*2, H]
            torch.testing.assert_close(combined.view(T, 2, -1).sum(dim=1), full(i, x), atol=1e-5, rtol=1e-5)
