"""Tiny random checkpoints for the FFN tests: the four `build_tiny` families, plus
variants that switch on routing features the tiny configs leave idle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.models.tiny import build_tiny, tiny_config

SEED = 0

VARIANTS: dict[str, tuple[str, dict]] = {
    # k=3 > topk_group: the group limit changes the choice (k=2 of the tiny config never does).
    "deepseek_v2_grouped_k3": ("deepseek_v2", dict(num_experts_per_tok=3, routed_scaling_factor=16.0)),
    # DeepSeek-V2-Lite's routing: plain softmax top-k over all experts.
    "deepseek_v2_greedy": ("deepseek_v2", dict(topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=3)),
    "deepseek_v3_k3_unnormalized": ("deepseek_v3", dict(num_experts_per_tok=3, norm_topk_prob=False)),
    # Four layers: 1 and 3 are sparse by the step, 3 is then forced dense.
    "qwen3_moe_sparse_step": (
        "qwen3_moe",
        dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False),
    ),
}


def _build_variant(name: str, out: Path) -> Path:
    """`tiny_config(family)` with `VARIANTS[name]` overrides, random N(0, 1/fan_in)
    weights from `SEED` (N(0, 0.05^2) for the score-correction bias), saved as
    safetensors without a tokenizer."""
    family, overrides = VARIANTS[name]
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for key, t in sorted(model.state_dict().items()):
            if key.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`checkpoint(name)`: folder of a tiny family (`build_tiny`) or of a `VARIANTS`
    entry, built once per session."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            out = tmp_path_factory.mktemp(name)
            built[name] = _build_variant(name, out) if name in VARIANTS else build_tiny(name, out / "ckpt", SEED)
        return built[name]

    return get


@pytest.fixture(scope="session")
def reference_model() -> Callable[[Path, torch.dtype], PreTrainedModel]:
    """`reference_model(folder, dtype)`: the transformers model of `folder`, its experts
    run by transformers' canonical per-expert loop (`experts_implementation="eager"`)."""

    def load(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager").eval()

    return load


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> FFNStack:
    """The tiny Llama's FFN stack, float32 on CPU, once per module."""
    checkpoint = build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return load_ffn_stack(Path(checkpoint), torch.float32, torch.device("cpu"))
