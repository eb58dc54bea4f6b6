"""FFN resize, make before break: a new EP shard built from the old one reads only the
experts it newly owns from the checkpoint, and equals a shard loaded from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.tiny import build_tiny

CPU = torch.device("cpu")


@pytest.mark.parametrize(("old", "new"), [((1, 0), (2, 0)), ((2, 0), (1, 0)), ((2, 1), (3, 1)), ((3, 2), (2, 0))])
def test_reshard_reads_only_newly_owned_experts(tmp_path: Path, old: tuple[int, int], new: tuple[int, int]) -> None:
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    (old_size, old_rank), (new_size, new_rank) = old, new
    before = load_ffn_stack(checkpoint, torch.float32, CPU, old_rank, old_size)
    resharded = load_ffn_stack(checkpoint, torch.float32, CPU, new_rank, new_size, reuse=before)
    fresh = load_ffn_stack(checkpoint, torch.float32, CPU, new_rank, new_size)
    assert resharded.checkpoint_tensors().keys() == fresh.checkpoint_tensors().keys()
    for key, tensor in fresh.checkpoint_tensors().items():
        assert torch.equal(resharded.checkpoint_tensors()[key], tensor), key
    experts = [block.experts for block in fresh.layers if isinstance(block, MoE)]
    held = {e for block in before.layers if isinstance(block, MoE) for e in block.experts.owned}
    newly = [e for e in experts[0].owned if e not in held]
    per_expert = sum(t.numel() * t.element_size() for t in (experts[0].gate_up[0], experts[0].down[0]))
    assert resharded.loaded_bytes == len(experts) * len(newly) * per_expert
    assert fresh.loaded_bytes == sum(p.numel() * p.element_size() for p in fresh.parameters())
