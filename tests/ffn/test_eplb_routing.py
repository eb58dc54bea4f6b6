"""EPLB on the model side, in one process: rows of a replicated expert split over its
replicas, shards loaded for a placement (from the checkpoint, or from the shard they
replace). The placements themselves: tests/eplb/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afd_ray.eplb.policy import place_layer
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.tiny import build_tiny

CPU = torch.device("cpu")
SKEWED = [[100, 90, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 50, 80]]
"""Routed rows per expert of the tiny qwen3_moe's two MoE layers (8 experts)."""


def test_each_row_is_computed_by_exactly_one_replica(tmp_path: Path) -> None:
    """Two ranks hold expert 0 (and 1): each row routed to it gives a nonzero output on
    one rank only, the rows alternate between the replicas, and the sum over the ranks
    is the single-rank output."""
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    placements = [place_layer(load, 2, 2) for load in SKEWED]
    assert placements[0].replicas()[:2] == [2, 2]
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    shards = [load_ffn_stack(checkpoint, torch.float32, CPU, r, 2, placements=placements) for r in range(2)]
    layer = next(i for i, block in enumerate(full.layers) if isinstance(block, MoE))
    hidden = torch.randn(64, full.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        routing = full.layers[layer].route(hidden)
        k = routing.ids.shape[1]
        rows = hidden.repeat_interleave(k, dim=0)  # [T*k, H]
        ids, weights = routing.ids.flatten(), routing.weights.flatten()
        outs = [shard.layers[layer].experts(rows, ids, weights) for shard in shards]  # [T*k, H] each
        full_out = full.layers[layer].experts(rows, ids, weights)
    nonzero = torch.stack([out.abs().sum(dim=1) > 0 for out in outs])  # [2, T*k]
    assert torch.equal(nonzero.sum(dim=0), torch.ones(len(ids), dtype=torch.int64))
    mine0 = nonzero[0][ids == 0]
    assert 0 < int(mine0.sum()) < len(mine0)  # both replicas of expert 0 compute rows
    assert abs(2 * int(mine0.sum()) - len(mine0)) <= 1 + int((ids == 0).sum()) // 2
    torch.testing.assert_close(outs[0] + outs[1], full_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_shard_for_a_placement_holds_the_checkpoint_weights(tmp_path: Path, reuse: bool) -> None:
    """Every slot holds its expert's checkpoint weights (replicas too); built from the
    contiguous shard it replaces, it reads only the experts that shard lacks."""
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    placements = [place_layer(load, 2, 2) for load in SKEWED]
    before = load_ffn_stack(checkpoint, torch.float32, CPU, 1, 2)
    shard = load_ffn_stack(checkpoint, torch.float32, CPU, 1, 2, reuse=before if reuse else None, placements=placements)
    experts = {layer: block.experts for layer, block in enumerate(full.layers) if isinstance(block, MoE)}
    read = 0
    for j, (layer, full_experts) in enumerate(experts.items()):
        mine = shard.layers[layer].experts
        assert mine.owned == placements[j].slots[1]
        for slot, expert in enumerate(mine.owned):
            assert torch.equal(mine.gate_up[slot], full_experts.gate_up[expert])
            assert torch.equal(mine.down[slot], full_experts.down[expert])
        new = set(mine.owned) - (set(before.layers[layer].experts.owned) if reuse else set())
        read += len(new) * (mine.gate_up[0].nbytes + mine.down[0].nbytes)
    if reuse:
        assert shard.loaded_bytes == read
    else:
        assert shard.loaded_bytes >= read
    with pytest.raises(ValueError, match="placements"):
        load_ffn_stack(checkpoint, torch.float32, CPU, 0, 2, placements=placements[:1])
