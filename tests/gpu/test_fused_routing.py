"""The FFN role's routing with vLLM's fused top-k kernels (`afd_ray.layers.fused_routing`)
against its torch routing (`Router.route_logits`, the CPU path that the float32 CPU tests
check against transformers) on the same gate logits: the same experts for every token,
the same weights within float32 rounding. Needs CUDA and vLLM's CUDA kernels; skips
visibly otherwise."""

from __future__ import annotations

import pytest
import torch

from afd_ray.layers.fused_routing import fused_routing
from afd_ray.layers.routing import Router
from afd_ray.layers.spec import RoutingSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

_SPECS = {
    # Qwen3-30B-A3B: 128 experts, top-8, renormalized, gate in the model dtype
    "qwen3_moe": RoutingSpec(128, 8, "softmax", 1, 1, "max", False, True, 1.0, float32_logits=False),
    # Mixtral: 8 experts, top-2, renormalized
    "mixtral": RoutingSpec(8, 2, "softmax", 1, 1, "max", False, True, 1.0, float32_logits=False),
    # DeepSeek-V3: 256 experts in 8 groups, best 4 groups, top-8, sigmoid with bias, scaled 2.5
    "deepseek_v3": RoutingSpec(256, 8, "sigmoid", 8, 4, "top2_sum", True, True, 2.5, float32_logits=True),
}


@pytest.mark.parametrize("name", sorted(_SPECS))
@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_fused_routing_equals_torch_routing(name: str, tokens: int) -> None:
    pytest.importorskip("vllm.model_executor.layers.fused_moe", reason="needs vLLM's fused MoE kernels")
    spec = _SPECS[name]
    torch.manual_seed(tokens)
    hidden_size = 2048
    router = Router(spec, hidden_size, torch.bfloat16).cuda()
    torch.nn.init.normal_(router.weight, std=hidden_size**-0.5)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.normal_(std=0.1)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(hidden.float() if spec.float32_logits else hidden, router.weight)
    assert fused_routing(spec, hidden, logits, router.e_score_correction_bias) is not None, "no fused kernel ran"
    fused = router(hidden)
    reference = router.route_logits(logits)
    assert fused.ids.dtype == torch.int64 and fused.weights.dtype == torch.float32
    fused_ids, order = fused.ids.sort(dim=-1)
    reference_ids, reference_order = reference.ids.sort(dim=-1)
    assert torch.equal(fused_ids, reference_ids), f"{name} T={tokens}: other experts chosen"
    torch.testing.assert_close(
        fused.weights.gather(1, order), reference.weights.gather(1, reference_order), rtol=1e-5, atol=1e-6
    )
