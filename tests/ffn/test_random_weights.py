"""`model.load_format: dummy` on the FFN role: `load_ffn_stack(random_weights=True)`
builds a model from its `config.json` alone (no safetensors), with the values vLLM's
dummy loader gives the same parameters, so that an AFD deployment with dummy weights
computes what plain vLLM with dummy weights computes (same routing, same expert
weights read per step: what the product benchmark compares)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from afd_ray.compat import attention_backend
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.mlp import GatedMLP
from afd_ray.layers.moe import MoE
from afd_ray.models import Family
from afd_ray.models.tiny import build_tiny, tiny_config

CPU = torch.device("cpu")


def test_config_json_alone_gives_vllm_dummy_values(tmp_path: Path) -> None:
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    tiny_config("deepseek_v3").save_pretrained(tmp_path)  # config.json only
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    stack = load_ffn_stack(tmp_path, torch.float32, CPU, random_weights=True)
    again = load_ffn_stack(tmp_path, torch.float32, CPU, random_weights=True)
    assert stack.loaded_bytes == 0
    for key, tensor in stack.checkpoint_tensors().items():
        assert torch.equal(tensor, again.checkpoint_tensors()[key]), key
        assert float(tensor.abs().max()) <= 1e-3 and float(tensor.abs().max()) > 0, key
    mlp = stack.layers[0]
    assert isinstance(mlp, GatedMLP)  # DeepSeek's first layer is dense
    inter, hidden_size = mlp.gate_proj.weight.shape
    merged = torch.empty(2 * inter, hidden_size)
    initialize_single_dummy_weight(merged)  # vLLM's gate_up_proj [2I, H], gate rows first
    assert torch.equal(mlp.gate_proj.weight, merged[:inter]) and torch.equal(mlp.up_proj.weight, merged[inter:])
    hidden = torch.randn(5, stack.hidden_size)
    with torch.inference_mode():
        for layer in range(stack.num_layers):
            out = stack(layer, hidden)
            assert out.shape == hidden.shape and torch.isfinite(out).all()
    assert any(isinstance(block, MoE) for block in stack.layers)


def _vllm_ffn_params(folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """The FFN-block parameters (`model.layers.{i}.mlp.*`) of a plain vLLM engine
    loaded with `load_format="dummy"` (in-process, CPU, float32), by vLLM's names, as
    its dummy loader left them (before `process_weights_after_loading`: vLLM's CPU
    linear layers repack their weights afterwards)."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    params: dict[str, torch.Tensor] = {}
    load_weights = DummyModelLoader.load_weights

    def recording(self: DummyModelLoader, model: torch.nn.Module, model_config: object) -> None:
        load_weights(self, model, model_config)
        params.update({n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n})

    monkeypatch.setattr(DummyModelLoader, "load_weights", recording)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        load_format="dummy",
        attention_backend=attention_backend(folder, "float32"),
    )
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return params


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_ffn_dummy_weights_equal_plain_vllm_dummy_weights(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every FFN tensor equals the plain vLLM engine's: the gate, the routed experts
    (vLLM's `w13`/`w2`), the shared experts and dense MLPs (`gate_up_proj` split in
    two). The earlier N(0, 1/fan_in) fill routed the same rows to other experts."""
    folder = build_tiny(family, tmp_path / family)
    threads = torch.get_num_threads()  # the vLLM CPU worker lowers it in-process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        vllm_params = _vllm_ffn_params(folder, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    stack = load_ffn_stack(folder, torch.float32, CPU, random_weights=True)
    compared = 0
    for layer, block in zip(stack.layer_ids, stack.layers, strict=True):
        prefix = f"model.layers.{layer}.mlp."
        mlps = {"": block} if isinstance(block, GatedMLP) else {}
        if isinstance(block, MoE):
            assert block.gate is not None
            pairs = [
                ("gate.weight", block.gate.weight),
                ("experts.w13_weight", block.experts.gate_up),
                ("experts.w2_weight", block.experts.down),
            ]
            if block.gate.e_score_correction_bias is not None:
                pairs.append(("gate.e_score_correction_bias", block.gate.e_score_correction_bias))
            if block.shared_experts is not None:
                mlps["shared_experts."] = block.shared_experts
        else:
            pairs = []
        for name, mlp in mlps.items():
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]
            pairs += [(f"{name}gate_up_proj.weight", gate_up), (f"{name}down_proj.weight", mlp.down_proj.weight)]
        for name, ours in pairs:
            key = prefix + name
            if key not in vllm_params:  # vLLM 0.32: `experts.routed_experts.w13_weight`
                key = prefix + name.replace("experts.", "experts.routed_experts.")
            theirs = vllm_params[key]
            assert theirs.shape == ours.shape and torch.equal(theirs.to(ours.dtype), ours), prefix + name
            compared += 1
    assert compared >= 3 * stack.num_layers
