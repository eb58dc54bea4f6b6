"""The FFN stack against transformers 5.19's own `model.model.layers[i].mlp` (the oracle)."""

from __future__ import annotations

import pytest
import torch

from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE

CPU = torch.device("cpu")
T = 64
MOE = [
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v2_grouped_k3",
    "deepseek_v2_greedy",
    "deepseek_v3_k3_unnormalized",
    "qwen3_moe_sparse_step",
]
GROUP_LIMIT_OR_BIAS_CHANGES_CHOICE = {"deepseek_v3", "deepseek_v2_grouped_k3", "deepseek_v3_k3_unnormalized"}


def _inputs(stack, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(T, stack.hidden_size, generator=gen) for _ in range(stack.num_layers)]


@pytest.mark.parametrize("name", ["llama", *MOE])
def test_every_layer_matches_transformers(name, checkpoint, reference_model):
    folder = checkpoint(name)
    ref = reference_model(folder, torch.float32)
    stack = load_ffn_stack(folder, torch.float32, CPU)
    assert stack.num_layers == ref.config.num_hidden_layers
    with torch.no_grad():
        for i, x in enumerate(_inputs(stack)):
            mlp = ref.model.layers[i].mlp
            assert isinstance(stack.layers[i], MoE) == hasattr(mlp, "experts"), f"layer {i} kind"
            torch.testing.assert_close(stack(i, x), mlp(x[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MOE)
def test_routing_matches_transformers(name, checkpoint, reference_model):
    folder = checkpoint(name)
    ref = reference_model(folder, torch.float32)
    stack = load_ffn_stack(folder, torch.float32, CPU)
    changed = 0
    with torch.no_grad():
        for i, x in enumerate(_inputs(stack)):
            block = stack.layers[i]
            if not isinstance(block, MoE):
                continue
            _, ref_weights, ref_ids = ref.model.layers[i].mlp.gate(x)
            routing = block.route(x)
            assert routing.ids.dtype == torch.int64 and routing.weights.dtype == torch.float32
            assert routing.ids.shape == routing.weights.shape == ref_ids.shape
            ids, order = routing.ids.sort(dim=-1)
            ref_sorted, ref_order = ref_ids.sort(dim=-1)
            assert torch.equal(ids, ref_sorted)
            torch.testing.assert_close(
                routing.weights.gather(1, order), ref_weights.float().gather(1, ref_order), atol=1e-6, rtol=1e-6
            )
            logits = x @ block.gate.weight.float().T  # [T, E]
            scores = logits.softmax(-1) if block.gate.spec.scoring == "softmax" else logits.sigmoid()
            plain = scores.topk(routing.ids.shape[1], dim=-1).indices.sort(dim=-1).values
            changed += int((plain != ids).any(dim=-1).sum())
    # The test exercises group limiting / the correction bias where the config has them.
    assert (changed > 0) == (name in GROUP_LIMIT_OR_BIAS_CHANGES_CHOICE)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_bfloat16_close_to_transformers(name, checkpoint, reference_model):
    """In bfloat16 the layer output stays close to transformers'. The routing follows
    vLLM, the engine afd_ray replaces: Qwen3's gate and (without `moe_router_dtype`)
    DeepSeek's compute their logits in bfloat16, so DeepSeek's top-k is checked
    against vLLM's own `grouped_topk` on those logits (transformers routes DeepSeek
    from float32 logits, which moves near-tie choices)."""
    folder = checkpoint(name)
    ref = reference_model(folder, torch.bfloat16)
    stack = load_ffn_stack(folder, torch.bfloat16, CPU)
    with torch.no_grad():
        for i, x in enumerate(_inputs(stack)):
            x = x.bfloat16()
            mlp = ref.model.layers[i].mlp
            out = stack(i, x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, mlp(x[None])[0], atol=3e-2, rtol=3e-2)
            if isinstance(stack.layers[i], MoE):
                gate = stack.layers[i].gate
                assert gate.weight.dtype == torch.bfloat16
                assert torch.equal(gate.weight, mlp.gate.weight.to(gate.weight.dtype))
                if gate.e_score_correction_bias is None:
                    ref_ids = mlp.gate(x)[2]
                else:
                    assert gate.e_score_correction_bias.dtype == torch.float32
                    assert torch.equal(gate.e_score_correction_bias, mlp.gate.e_score_correction_bias)
                    ref_ids = _vllm_grouped_topk_ids(gate, x)
                assert torch.equal(gate(x).ids.sort(-1).values, ref_ids.sort(-1).values.long())


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v2_grouped_k3"])
@pytest.mark.parametrize("scale", [1.0, 1e-5])
def test_deepseek_v2_bfloat16_routes_as_vllm(name, scale, checkpoint):
    """In bfloat16 DeepSeek-V2's routing (ids and weights) equals vLLM's `grouped_topk`
    on the same model-dtype logits: softmax, choice, renormalization and scaling in
    bfloat16 (`RoutingSpec.float32_scores` False). Scale 1e-5 gives tiny logits, as
    vLLM's dummy weights, where every bfloat16 score ties at 1/E and vLLM sends every
    token to the same experts (on an H200 this made plain vLLM's MoE layers read 6 of
    64 experts per step where the FFN role's float32 softmax read about 47)."""
    stack = load_ffn_stack(checkpoint(name), torch.bfloat16, CPU)
    layers = [(i, block) for i, block in enumerate(stack.layers) if isinstance(block, MoE)]
    assert layers and not layers[0][1].gate.spec.float32_scores
    for (i, block), x in zip(layers, _inputs(stack), strict=False):
        x = (x * scale).bfloat16()
        routing = block.gate(x)
        ref_weights, ref_ids = _vllm_grouped_topk(block.gate, x)
        ids, order = routing.ids.sort(dim=-1)
        ref_sorted, ref_order = ref_ids.long().sort(dim=-1)
        assert torch.equal(ids, ref_sorted), f"layer {i}"
        assert torch.equal(routing.weights.gather(1, order), ref_weights.gather(1, ref_order)), f"layer {i}"
        if scale < 1:
            assert ids.unique().numel() == ids.shape[1]  # every token: the same experts


def _vllm_grouped_topk(gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's DeepSeek routing of `x` `[T, H]`: `GateLinear` without an `out_dtype`
    (logits in the model dtype), then `grouped_topk` (uncompiled); weights `[T, k]`
    float32 and ids `[T, k]` int32."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    spec = gate.spec
    logits = torch.nn.functional.linear(x, gate.weight)  # [T, E] model dtype
    route = getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk)
    return route(
        x,
        logits,
        spec.top_k,
        spec.renormalize,
        spec.num_groups,
        spec.top_groups,
        spec.scoring,
        spec.scaling_factor,
        gate.e_score_correction_bias,
    )


def _vllm_grouped_topk_ids(gate, x: torch.Tensor) -> torch.Tensor:
    """vLLM's DeepSeek routing of `x` `[T, H]`: `GateLinear` without an `out_dtype`
    (logits in the model dtype), then `grouped_topk`; `[T, k]` expert ids. The
    uncompiled function: its `torch.compile` wrapper would build a CPU kernel here."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    spec = gate.spec
    logits = torch.nn.functional.linear(x, gate.weight)  # [T, E] bfloat16
    route = getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk)
    _, ids = route(
        x,
        logits,
        spec.top_k,
        spec.renormalize,
        spec.num_groups,
        spec.top_groups,
        spec.scoring,
        spec.scaling_factor,
        gate.e_score_correction_bias,
    )
    return ids


def test_deepseek_gate_in_float32_where_the_config_asks(checkpoint):
    """`moe_router_dtype: float32` (vLLM's `_get_moe_router_dtype`) keeps the gate, and
    its logits, in float32 in a bfloat16 model."""
    from transformers import AutoConfig

    from afd_ray.layers.family import ffn_layout

    config = AutoConfig.from_pretrained(checkpoint("deepseek_v3"))
    assert not ffn_layout(config).moe.routing.float32_logits
    config.moe_router_dtype = "float32"
    assert ffn_layout(config).moe.routing.float32_logits
