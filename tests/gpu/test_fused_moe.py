"""The FFN role's MoE layer on CUDA with vLLM's fused MoE kernels (`MoE.routed_fused`).

Oracle: the same layer's routed experts in float32 by a loop over experts, on the same
bfloat16 random weights (`afd_ray.bench.moe_layer`): relative Frobenius error within
2e-2; the CUDA graph replay of the whole layer equal to the eager call, and the layer
(shared experts on a side stream) equal to its parts run on one stream, bit for
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
    results = run(argparse.Namespace(out=str(out), tokens=[1, 64, 200], iters=3, sweep=False, quantization=None))
    print(json.dumps(results, indent=1))
    for name in moe_shapes():
        for tokens, record in results[name]["tokens"].items():
            assert record["graph_equals_eager"], (name, tokens, record)
            assert record["overlap_equals_serial"], (name, tokens, record)
            assert record["fused_rel_err_vs_fp32"] <= 2e-2, (name, tokens, record)


def test_bfloat16_sum_rounds_once_on_cuda() -> None:
    """`MoE.output` adds the fused kernels' bfloat16 output and the shared experts' in
    one bfloat16 add: CUDA computes it in float32 and rounds once, as the float32 sum
    cast once does (`tests/ffn/test_moe_output.py` on CPU)."""
    generator = torch.Generator("cuda").manual_seed(0)
    for scale in (1.0, 1e-3, 1e4):
        routed = (torch.randn(512, 2048, generator=generator, device="cuda") * scale).bfloat16()
        shared = torch.randn(512, 2048, generator=generator, device="cuda").bfloat16()
        assert torch.equal(routed + shared, (routed.float() + shared.float()).bfloat16())
