"""A split MoE output (compiled attention engines) against plain vLLM's MoE layer tail,
bfloat16, on CPU with a real FFN runtime over `shm`.

vLLM's MoE layer returns the routed and the shared experts' outputs from its opaque
fused-MoE op, each rounded to bfloat16, then computes `routed * routed_scaling_factor
+ shared` as torch ops (`MoERunner.forward`). Compiled, inductor fuses that sum into
the next layer's residual add and RMSNorm, so it is never rounded to bfloat16. The
FFN role used to return the sum already rounded (F2A `[T, H]`), which moved a tiny
DeepSeek-V3's greedy tokens against plain vLLM under CUDA graphs on an H200 (66 of 96
equal). Now, for torch.compile'd engines, it sends the parts (`[T, P, H]`) and the
attention side finishes them (`combine_moe_parts`) in its own compiled piece.

The test runs the attention side's path through the FFN boundary op compiled by
inductor, the parts coming from the FFN runtime, and checks the next layer's RMSNorm
input and residual bit for bit against vLLM's own tail code on the same parts,
compiled the same way; the old rounded sum differs from it on this case.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.layernorm import RMSNorm

from afd_ray.attention.ffn_client import ASSIGNMENT_ENV, reset_ffn_client
from afd_ray.attention.ffn_op import begin_ffn_step, remote_ffn
from afd_ray.attention.models.base import combine_moe_parts
from afd_ray.connector.channel import FFNChannel
from afd_ray.control.membership import AttentionAssignment
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.ffn.moe import MoE
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny

TOKENS = 16
SCALE = 2.5  # the tiny DeepSeek-V3's routed_scaling_factor
TIMEOUT_S = 120.0  # the step's first exchange waits for inductor's compile


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FFNStack]:
    """The tiny DeepSeek-V3's FFN stack for compiled attention engines (bfloat16),
    served by a real FFN runtime over `shm` that this process's `ffn_client()` uses."""
    checkpoint = build_tiny("deepseek_v3", tmp_path / "deepseek_v3")
    stack = load_ffn_stack(checkpoint, torch.bfloat16, torch.device("cpu"), attention_compiled=True)
    channel = FFNChannel("127.0.0.1", "gloo", timeout_s=TIMEOUT_S)
    runtime = FFNRuntime(stack, channel, torch.bfloat16, poll_s=0.05, batch_window_s=0.01)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    address = channel.address
    assignment = AttentionAssignment(
        peer=0, ffn_rank=0, host=address.host, store_port=address.store_port, control_port=address.control_port,
        epoch=0, transport="shm", timeout_s=TIMEOUT_S,
    )  # fmt: skip
    monkeypatch.setenv(ASSIGNMENT_ENV, assignment.model_dump_json())
    try:
        yield stack
    finally:
        reset_ffn_client()
        runtime.stop()
        loop.join(TIMEOUT_S)


_RUNNER = SimpleNamespace(routed_scaling_factor=SCALE)
"""What vLLM's `MoERunner` scaling method reads of its runner."""


def _vllm_tail(fused: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """vLLM's MoE layer after its fused-MoE op (`MoERunner.forward`, TP 1), with its
    own scaling code."""
    shared, fused = MoERunner._maybe_apply_routed_scale_to_output(_RUNNER, shared, fused)
    return shared + fused


def test_split_output_fuses_into_the_next_norm_as_plain_vllm(served: FFNStack) -> None:
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
