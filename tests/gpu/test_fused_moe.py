"""The FFN role's MoE layer on CUDA with vLLM's fused MoE kernels (`MoE.routed_fused`).

Oracle: the same layer's routed experts in float32 by a loop over experts, on the same
bfloat16 random weights (`afd_ray.bench.moe_layer`): relative Frobenius error within
2e-2, and the CUDA graph replay of the whole layer equal to the eager call bit for
bit. Needs CUDA and vLLM (its Triton kernels); skips visibly otherwise.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]


def test_fused_moe_layer_matches_float32(tmp_path) -> None:
    pytest.importorskip("vllm.model_executor.layers.fused_moe", reason="needs vLLM's fused MoE kernels")
    from afd_ray.bench.moe_layer import moe_shapes, run

    out = tmp_path / "moe.json"
    results = run(argparse.Namespace(out=str(out), tokens=[1, 64, 200], iters=3, sweep=False))
    print(json.dumps(results, indent=1))
    for name in moe_shapes():
        for tokens, record in results[name]["tokens"].items():
            assert record["graph_equals_eager"], (name, tokens, record)
            assert record["fused_rel_err_vs_fp32"] <= 2e-2, (name, tokens, record)
