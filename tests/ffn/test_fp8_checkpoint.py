"""FP8 checkpoints (config.json `quantization_config`, `quant_method: fp8`) on the FFN
role, on CPU: the config accepts them (and refuses other quant methods), and
`load_ffn_stack` reads each EP rank's FP8 experts and their scales, block or per
tensor, and dequantizes the shared experts' and dense MLPs' FP8 linears. The tiny
DeepSeek-V3 (dense layer 0, MoE layers 1-2 with a shared expert, 8 experts of
H 128, I 64) is quantized by `quantize_fp8_checkpoint`. The kernels need CUDA:
tests/gpu/test_fp8_moe.py runs them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from afd_ray.config import AFDConfig
from afd_ray.config.model import ModelConfig
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.fp8 import Fp8Experts, dequantize_fp8
from afd_ray.layers.mlp import GatedMLP
from afd_ray.models.tiny import quantize_fp8_checkpoint
from afd_ray.weights import dequantized_linears

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
BLOCK = (32, 32)
"""Real checkpoints use [128, 128]; the tiny experts' I is 64."""


@pytest.fixture(scope="module")
def fp8(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`fp8(block_shape)`: the tiny DeepSeek-V3 quantized, once per module and shape."""
    built: dict[tuple[int, int] | None, Path] = {}

    def get(block_shape: tuple[int, int] | None) -> Path:
        if block_shape not in built:
            out = tmp_path_factory.mktemp("fp8") / "ckpt"
            built[block_shape] = quantize_fp8_checkpoint(checkpoint("deepseek_v3"), out, block_shape)
        return built[block_shape]

    return get


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _within_fp8_rounding(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """`got` is `want` rounded to e4m3 under `scale` (elementwise, same shape): within
    2^-4 relative (3 mantissa bits) or half the subnormal step 2^-10 * scale."""
    return bool(((got - want).abs() <= 2**-4 * want.abs() + 2**-10 * scale + 1e-12).all())


def _full_scale(scale: torch.Tensor, shape: torch.Size, block_shape: tuple[int, int] | None) -> torch.Tensor:
    return dequantize_fp8(torch.ones(shape, dtype=torch.float8_e4m3fn), scale, block_shape)


@pytest.mark.parametrize("block_shape", [BLOCK, None], ids=["block", "per-tensor"])
def test_config_accepts_an_fp8_checkpoint_on_cuda_only(fp8: Callable[..., Path], block_shape) -> None:
    source = str(fp8(block_shape))
    model = ModelConfig(source=source)
    assert model.checkpoint_fp8 is not None and model.checkpoint_fp8.block_shape == block_shape
    assert model.fp8 and model.quantization is None
    assert AFDConfig(platform="cuda", model=model).model.checkpoint_fp8 == model.checkpoint_fp8
    with pytest.raises(ValidationError, match=rf"model\.source: '{source}' is an FP8 checkpoint and needs FP8 kernels"):
        AFDConfig(model=model)
    with pytest.raises(ValidationError, match=r"model\.quantization: fp8 with .* already an FP8 checkpoint"):
        ModelConfig(source=source, quantization="fp8")
    with pytest.raises(ValidationError, match=r"model\.load_format: dummy with .* an FP8 checkpoint"):
        ModelConfig(source=source, load_format="dummy")
    with pytest.raises(ValidationError, match=r"gate_placement: gate_on_attention with .* an FP8 checkpoint"):
        AFDConfig(platform="cuda", model=model, gate_placement="gate_on_attention")


@pytest.mark.parametrize(
    ("quantization_config", "error"),
    [
        ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq'\); afd_ray serves FP8 checkpoints"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme 'static'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\] is not two positive"),
        ("fp8", r"quant_method None"),
    ],
    ids=["awq", "static", "one-dim-block", "not-a-mapping"],
)
def test_other_quantized_checkpoints_are_refused_naming_the_source(
    fp8: Callable[..., Path], tmp_path: Path, quantization_config: object, error: str
) -> None:
    config = json.loads((fp8(BLOCK) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    with pytest.raises(ValidationError, match=rf"model\.source: '{tmp_path}'.*{error}"):
        ModelConfig(source=str(tmp_path))


def test_an_ep_rank_reads_its_block_fp8_experts_and_scales(
    fp8: Callable[..., Path], checkpoint: Callable[[str], Path]
) -> None:
    """EP rank 1 of 2 holds experts 4-7 of each MoE layer: their FP8 bytes and block
    scales as stored, dequantized within FP8 rounding of the float32 source; the
    shared expert and the dense MLP are dequantized to float32 exactly as stored."""
    folder = fp8(BLOCK)
    stored, source = _tensors(folder), _tensors(checkpoint("deepseek_v3"))
    stack = load_ffn_stack(folder, torch.float32, CPU, ep_rank=1, ep_size=2)
    assert [block.experts.owned for block in stack.moe_blocks] == [(4, 5, 6, 7)] * 2
    for layer, block in zip(stack.layer_ids, stack.layers, strict=True):
        prefix = f"model.layers.{layer}.mlp."
        if isinstance(block, GatedMLP):
            mlps = {"": block}
        else:
            experts = block.experts
            assert isinstance(experts, Fp8Experts) and experts.block_shape == BLOCK
            assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up_scale.shape == (4, 4, 4)
            for local, expert in enumerate(experts.owned):
                name = f"{prefix}experts.{expert}."
                w13, w2 = experts.dequantized(local)
                for proj, got in (("gate_proj", w13[:64]), ("up_proj", w13[64:]), ("down_proj", w2)):
                    weight, scale = stored[f"{name}{proj}.weight"], stored[f"{name}{proj}.weight_scale_inv"]
                    assert torch.equal(got, dequantize_fp8(weight, scale, BLOCK)), (layer, expert, proj)
                    full = _full_scale(scale, weight.shape, BLOCK)
                    assert _within_fp8_rounding(got, source[f"{name}{proj}.weight"], full), (layer, expert, proj)
                assert torch.equal(
                    experts.gate_up[local, :64].view(torch.uint8), stored[f"{name}gate_proj.weight"].view(torch.uint8)
                )
            mlps = {"shared_experts.": block.shared_experts}
        for inner, mlp in mlps.items():
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{prefix}{inner}{proj}."
                want = dequantize_fp8(stored[f"{name}weight"], stored[f"{name}weight_scale_inv"], BLOCK)
                assert getattr(mlp, proj).weight.dtype == torch.float32
                assert torch.equal(getattr(mlp, proj).weight, want), name
    assert stack.loaded_bytes == sum(t.nbytes for t in stack.checkpoint_tensors().values())  # FP8 experts: 1 B
    with pytest.raises(ValueError, match="FP8 experts run on CUDA only"):
        stack.moe_blocks[0].experts(torch.zeros(2, 128), torch.tensor([4, 5]), torch.ones(2))


def test_per_tensor_gate_and_up_scales_merge_into_their_max(
    fp8: Callable[..., Path], checkpoint: Callable[[str], Path]
) -> None:
    """One `w13` scale per expert, the larger of its gate and up scales, the other half
    requantized to it (vLLM's `process_fp8_weight_tensor_strategy_moe`): within one
    more FP8 rounding of the stored weights."""
    folder = fp8(None)
    stored = _tensors(folder)
    stack = load_ffn_stack(folder, torch.bfloat16, CPU)
    block = stack.moe_blocks[0]
    experts = block.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_scale.shape == (8,) and experts.down_scale.shape == (8,)
    for local, expert in enumerate(experts.owned):
        name = f"model.layers.1.mlp.experts.{expert}."
        gate, up = (stored[f"{name}{proj}.weight_scale"] for proj in ("gate_proj", "up_proj"))
        assert gate != up  # the merge is exercised
        assert float(experts.gate_up_scale[local]) == float(torch.maximum(gate, up))
        assert torch.equal(experts.shard_scale[local], experts.gate_up_scale[local].expand(2))
        w13, _ = experts.dequantized(local)
        for proj, got in (("gate_proj", w13[:64]), ("up_proj", w13[64:])):
            want = dequantize_fp8(stored[f"{name}{proj}.weight"], stored[f"{name}{proj}.weight_scale"], None)
            assert _within_fp8_rounding(got, want, experts.gate_up_scale[local]), (expert, proj)
    assert block.shared_experts.down_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("block_shape", [BLOCK, None], ids=["block", "per-tensor"])
def test_a_resize_reuses_the_fp8_experts_it_holds(fp8: Callable[..., Path], block_shape) -> None:
    """`reuse` (an FFN resize, 2 EP ranks -> 1): the experts EP rank 0 holds are copied
    in FP8 with their scales; the stack equals one read from the checkpoint alone."""
    folder = fp8(block_shape)
    half = load_ffn_stack(folder, torch.float32, CPU, ep_rank=0, ep_size=2)
    whole = load_ffn_stack(folder, torch.float32, CPU, reuse=half)
    fresh = load_ffn_stack(folder, torch.float32, CPU)
    assert whole.loaded_bytes < fresh.loaded_bytes
    for got, want in zip(whole.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_an_fp8_weight_without_its_scale_is_an_error() -> None:
    weight = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    params = [(0, "down_proj.weight", weight), (0, "up_proj.weight_scale_inv", torch.ones(1, 1))]
    with pytest.raises(ValueError, match=r"without their weight_scale_inv.*layers\.0\.mlp\.down_proj\.weight"):
        list(dequantized_linears(params, BLOCK, "weight_scale_inv"))
