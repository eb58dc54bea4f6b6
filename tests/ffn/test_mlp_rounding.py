"""`GatedMLP`'s activation rounding against vLLM's own `SiluAndMul` in bfloat16.

A compiled vLLM engine runs `SiluAndMul.forward_native` through torch.compile
(inductor keeps `silu(gate) * up` in float32 and rounds once); an eager one runs its
kernel, which rounds `silu(gate)` first (as eager torch does). The FFN role follows
the attention engine's mode (`act_in_float32`); the two differ in bfloat16, which
moved a tiny DeepSeek-V3's greedy tokens against plain vLLM with CUDA graphs.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import SiluAndMul

from afd_ray.layers.mlp import GatedMLP


def test_activation_rounds_as_the_engine_mode_does() -> None:
    torch.manual_seed(0)
    once = GatedMLP(64, 256, "silu", False, torch.bfloat16, act_in_float32=True)
    twice = GatedMLP(64, 256, "silu", False, torch.bfloat16, act_in_float32=False)
    twice.load_state_dict(once.state_dict())
    x = torch.randn(32, 64).bfloat16()
    with torch.no_grad():
        gate_up = torch.cat([once.gate_proj(x), once.up_proj(x)], dim=-1)  # [T, 2I], vLLM's layout
        compiled = once.down_proj(torch.compile(SiluAndMul.forward_native, dynamic=False)(gate_up))
        eager = once.down_proj(SiluAndMul.forward_native(gate_up))
        assert not torch.equal(compiled, eager)  # the case tells the two apart
        assert torch.equal(twice(x), eager)  # the same eager torch ops on any CPU
        # Inductor's vectorized float32 silu may differ from eager torch's by an ulp,
        # depending on the CPU's vector ISA (AVX2, AVX-512, AMX): compare distances
        # rather than bits, so that the check holds on any CPU.
        once_gap = (once(x).float() - compiled.float()).norm()
        twice_gap = (twice(x).float() - compiled.float()).norm()
        assert once_gap <= 0.1 * twice_gap, (once_gap, twice_gap)
