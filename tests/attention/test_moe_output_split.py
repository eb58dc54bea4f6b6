"""The FFN boundary of a compiled AFD attention engine against the one piece a
compiled plain vLLM engine runs there, bfloat16, on CPU with a real FFN runtime over
`shm`.

A compiled plain engine runs a layer's post-attention norm, its FFN (vLLM's MoE layer:
the opaque fused-MoE op, then `routed * routed_scaling_factor + shared` as torch ops,
`MoERunner.forward`) and the next layer's fused residual add + RMSNorm in one inductor
piece. Inductor keeps float32 there: neither the MoE sum nor the residual
`attention + residual` is rounded to bfloat16 before the next norm. The AFD engine's
FFN boundary is a splitting op, so the piece ends there. It used to receive the MoE
sum rounded (F2A `[T, H]`) and read the rounded residual of the piece before; on an
H200 a tiny DeepSeek-V3 then matched plain vLLM's greedy tokens under CUDA graphs at
66 (sum rounded) and 73 (parts, residual rounded) of 96 positions. Now the FFN role
sends the parts (`[T, P, H]`) and the attention layer finishes them and recomputes the
residual after the boundary (`AFDDecoderLayer._post_attention`, `combine_moe_parts`).

The test compiles the AFD layer's `_post_attention` plus the next norm as vLLM's
piecewise backend does (vLLM's own `split_graph` at the AFD splitting ops, each other
piece compiled by inductor), and plain vLLM's ops (its MoE tail code) on the same FFN
parts as one inductor graph, and checks the next norm's output and residual bit for
bit. The second test shows, on CPU, what the old F2A sum changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._inductor.config
from torch import fx, nn
from torch._inductor.compile_fx import compile_fx
from vllm.compilation.backends import split_graph
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.layernorm import RMSNorm

from afd_ray.attention.ffn_op import SPLITTING_OPS, begin_ffn_step, remote_ffn
from afd_ray.attention.models.base import AFDDecoderLayer, combine_moe_parts
from afd_ray.compat import splitting_ops_with
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.tiny import build_tiny
from ffn_peer import ffn_peer

TOKENS = 16
TIMEOUT_S = 120.0  # a step's exchanges wait for inductor's compiles
SCALE = 2.5  # the tiny DeepSeek-V3's routed_scaling_factor
_RUNNER = SimpleNamespace(routed_scaling_factor=SCALE)
"""What vLLM's `MoERunner` scaling method reads of its runner."""


@pytest.fixture(autouse=True)
def avx2_kernels() -> Iterator[None]:
    """Inductor's CPU kernels at one vector width (256 bits: AVX2) on every x86 CPU:
    it picks the widest the CPU has otherwise, and bit-equality between differently
    fused kernels is checked on the kernels this test was written against."""
    with torch._inductor.config.patch({"cpp.simdlen": 256}):
        yield


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return build_tiny("deepseek_v3", tmp_path / "deepseek_v3")


@pytest.fixture
def served(checkpoint: Path) -> Iterator[FFNStack]:
    """The tiny DeepSeek-V3's FFN stack for compiled attention engines (bfloat16),
    served by a real FFN runtime over `shm` whose client this process's ops use."""
    stack = load_ffn_stack(checkpoint, torch.bfloat16, torch.device("cpu"), attention_compiled=True)
    with ffn_peer(stack, torch.bfloat16, timeout_s=TIMEOUT_S):
        yield stack


class _Layer(AFDDecoderLayer):
    """The FFN half of AFD decoder layer `layer_idx`: its post-attention norm and
    boundary, as the AFD model classes build them."""

    def __init__(self, vllm_config: VllmConfig, layer_idx: int, hidden_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=1e-6, dtype=torch.bfloat16)
        self._build_ffn_half(vllm_config)


class _Inductor(nn.Module):
    """One piece of the split graph, compiled by inductor at its first call."""

    def __init__(self, graph: fx.GraphModule) -> None:
        super().__init__()
        self.graph_module = graph
        self.compiled: Callable | None = None

    def forward(self, *args: torch.Tensor):
        if self.compiled is None:
            self.compiled = compile_fx(self.graph_module, list(args))
        return self.compiled(*args)


def _piecewise(graph: fx.GraphModule, example_inputs: list[torch.Tensor]) -> fx.GraphModule:
    """vLLM's piecewise backend in small: split at the splitting ops (the AFD ones
    included) with vLLM's `split_graph`, and compile every other piece with inductor."""
    split_gm, items = split_graph(graph, splitting_ops_with(SPLITTING_OPS))
    for item in items:
        if not item.is_splitting_graph:
            setattr(split_gm, item.submod_name, _Inductor(item.graph))
    return split_gm


def _vllm_tail(fused: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """vLLM's MoE layer after its fused-MoE op (`MoERunner.forward`, TP 1), with its
    own scaling code."""
    shared, fused = MoERunner._maybe_apply_routed_scale_to_output(_RUNNER, shared, fused)
    return shared + fused


def test_compiled_boundary_computes_as_plain_vllms_one_piece(served: FFNStack, checkpoint: Path) -> None:
    moe_layers = [i for i, block in enumerate(served.layers) if isinstance(block, MoE)]
    layer = moe_layers[0]
    config = VllmConfig(model_config=ModelConfig(str(checkpoint), dtype="bfloat16", enforce_eager=False))
    with set_current_vllm_config(config):
        afd = _Layer(config, layer, served.hidden_size)
        next_norm = RMSNorm(served.hidden_size, eps=1e-6, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for norm in (afd.post_attention_layernorm, next_norm):
        norm.weight.data.copy_(torch.rand(served.hidden_size, generator=generator) + 0.5)
    attention, residual = (torch.randn(TOKENS, served.hidden_size, generator=generator).bfloat16() for _ in range(2))
    assert afd._moe_parts == 2 and afd._recompute_residual

    def afd_piecewise(attention: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual = afd._post_attention(attention, residual)  # the FFN boundary splits here
        return next_norm(out, residual)

    def plain_one_piece(attention: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = afd.post_attention_layernorm(attention, residual)
        parts = remote_ffn(hidden, layer, 2)  # opaque, as vLLM's fused-MoE op: [T, 2, H]
        return next_norm(_vllm_tail(parts[:, 0], parts[:, 1]), residual)

    def step(fn: Callable, backend: Callable | str) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass: every layer's exchange in order, layer `layer` by `fn`."""
        torch._dynamo.reset()
        begin_ffn_step(TOKENS)
        for i in range(served.num_layers):
            if i == layer:
                got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(attention, residual)
            else:
                remote_ffn(attention, i, 2 if i in moe_layers else None)
        return got

    with torch.inference_mode(), set_current_vllm_config(config):
        expected = step(plain_one_piece, "inductor")
        got = step(afd_piecewise, _piecewise)
    for got_t, expected_t in zip(got, expected, strict=True):  # normed, residual
        assert torch.equal(got_t, expected_t)
    # Without the residual recompute the CPU gives the same bits: CPU inductor reads
    # the stored (rounded) residual in the plain piece too, where CUDA inductor
    # recomputed it (H200 kernels, benchmarks/results/h200-2026-12-02d-mla.log).


def test_split_output_fuses_into_the_next_norm_as_plain_vllm(served: FFNStack) -> None:
    """The MoE parts alone: finished after the boundary they give plain vLLM's bits
    (here also on CPU), the sum rounded once (the old F2A) does not."""
    moe_layers = [i for i, block in enumerate(served.layers) if isinstance(block, MoE)]
    assert all(served.layers[i].split_output for i in moe_layers)
    layer = moe_layers[0]
    generator = torch.Generator().manual_seed(0)
    hidden, residual = (torch.randn(TOKENS, served.hidden_size, generator=generator).bfloat16() for _ in range(2))
    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(served.hidden_size, eps=1e-6, dtype=torch.bfloat16)
    norm.weight.data.copy_(torch.rand(served.hidden_size, generator=generator) + 0.5)

    def afd(hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention side from the MoE layer's FFN boundary to the next layer's
        fused residual add + RMSNorm."""
        parts = remote_ffn(hidden, layer, 2)  # [T, 2, H]
        return norm.forward_native(combine_moe_parts(parts, SCALE), residual)

    def plain(fused: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return norm.forward_native(_vllm_tail(fused, shared), residual)

    torch._dynamo.reset()
    with torch.inference_mode(), set_current_vllm_config(VllmConfig()):
        begin_ffn_step(TOKENS)
        for i in range(served.num_layers):  # one step: every layer in order, the MoE layer compiled
            if i == layer:
                got = torch.compile(afd, fullgraph=True, dynamic=False)(hidden, residual)
            else:
                remote_ffn(hidden, i, 2 if i in moe_layers else None)
        parts = served(layer, hidden)  # [T, 2, H]: routed (weights unscaled), shared
        fused, shared = parts[:, 0].contiguous(), parts[:, 1].contiguous()
        expected = torch.compile(plain, fullgraph=True, dynamic=False)(fused, shared, residual)
        rounded = (fused.float() * SCALE + shared.float()).bfloat16()  # the old F2A: the sum rounded once
        old = torch.compile(norm.forward_native, fullgraph=True, dynamic=False)(rounded, residual)
    assert parts.shape == (TOKENS, 2, served.hidden_size)
    for got_t, expected_t, old_t in zip(got, expected, old, strict=True):  # normed, residual
        assert torch.equal(got_t, expected_t)
        assert not torch.equal(old_t, expected_t)  # the case tells the two apart
