"""`MoE.output`: the routed and shared experts' sum is taken in float32 and rounded
once to the model dtype, whichever dtype the routed experts come in (float32 from
torch's grouped GEMMs, the model dtype from vLLM's fused kernels)."""

from __future__ import annotations

import torch

from afd_ray.layers.experts import ExpertSlots
from afd_ray.layers.moe import MoE
from afd_ray.layers.spec import MoEShape, RoutingSpec


def sum_rounded_once(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return (routed.float() + shared.float()).to(shared.dtype)


def test_model_dtype_parts_sum_in_float32_rounded_once() -> None:
    spec = RoutingSpec(8, 2, "softmax", 1, 1, "max", False, False, 1.0, False)
    with torch.device("meta"):
        moe = MoE(MoEShape(spec, 16, 32), ExpertSlots.block(range(8), 8), 64, "silu", False, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-3, 1e4):  # exponents far apart: the float32 sum itself rounds
        routed = (torch.randn(512, 64, generator=generator) * scale).bfloat16()
        shared = torch.randn(512, 64, generator=generator).bfloat16()
        want = sum_rounded_once(routed, shared)
        assert torch.equal(moe.output(routed, shared, torch.bfloat16), want)
        assert torch.equal(moe.output(routed.float(), shared, torch.bfloat16), want)
