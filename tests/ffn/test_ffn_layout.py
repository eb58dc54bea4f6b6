"""Family configs -> FFN layout and routing spec; the gate as a standalone module."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.layers.family import ffn_layout
from afd_ray.layers.routing import Router
from afd_ray.layers.spec import RoutingSpec
from afd_ray.models.tiny import tiny_config
from afd_ray.weights import ffn_layer_params


def test_layouts():
    assert ffn_layout(tiny_config("llama")).moe is None
    v3 = ffn_layout(tiny_config("deepseek_v3"))
    assert v3.moe_layers == {1, 2}
    assert v3.moe.shared_intermediate_size == 64
    assert v3.moe.routing == RoutingSpec(
        num_experts=8,
        top_k=2,
        scoring="sigmoid",
        num_groups=4,
        top_groups=2,
        group_score="top2_sum",
        correction_bias=True,
        renormalize=True,
        scaling_factor=2.5,
        float32_logits=False,
    )
    qwen = ffn_layout(tiny_config("qwen3_moe"))
    assert qwen.moe_layers == {0, 1} and qwen.moe.shared_intermediate_size == 0
    assert not qwen.moe.routing.float32_logits


@pytest.mark.parametrize(
    ("family", "overrides", "match"),
    [
        ("deepseek_v3", dict(scoring_func="softmax"), "deepseek_v3"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method"),
        ("deepseek_v3", dict(n_group=3), "groups"),
        ("deepseek_v2", dict(num_experts_per_tok=5), "top_k"),
    ],
)
def test_unsupported_routing_raises(family, overrides, match):
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        ffn_layout(config)


def test_unsupported_model_type_raises():
    config = tiny_config("llama")
    config.model_type = "olmoe"
    with pytest.raises(ValueError, match="model_type"):
        FFNStack(config)


def test_old_constructor_still_works():
    stack = FFNStack(tiny_config("llama"))
    assert stack.num_layers == 2 and stack.layers[0].down_proj.weight.dtype == torch.get_default_dtype()


def test_router_standalone_matches_stack(checkpoint):
    """The gate alone (as the attention role would hold it for gate_on_attention)."""
    folder = checkpoint("deepseek_v3")
    stack = load_ffn_stack(folder, torch.float32, torch.device("cpu"))
    spec = ffn_layout(AutoConfig.from_pretrained(folder)).moe.routing
    router = Router(spec, stack.hidden_size, torch.float32)
    params = ffn_layer_params(folder)
    router.load_state_dict(
        {n.removeprefix("gate."): t for layer, n, t in params if layer == 2 and n.startswith("gate.")}
    )
    x = torch.randn(16, stack.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(router(x).ids, stack.layers[2].route(x).ids)
    assert torch.equal(router(x).weights, stack.layers[2].route(x).weights)


def test_missing_tensor_raises(checkpoint, tmp_path):
    folder = checkpoint("qwen3_moe")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.experts.5.up_proj.weight'\]"):
        load_ffn_stack(tmp_path, torch.float32, torch.device("cpu"))
    load_ffn_stack(tmp_path, torch.float32, torch.device("cpu"), ep_rank=0, ep_size=2)  # expert 5 is rank 1's
