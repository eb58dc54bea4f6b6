"""Expert load per (MoE layer, expert) over a sliding window of FFN steps (EPLB's input):
the meter's ring on its own, and an FFN runtime serving an attention peer over the
real connector, its window checked against the stack's own routing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.layers.moe import MoE
from afd_ray.models.tiny import build_tiny
from afd_ray.observability.meter import StepMeter

CPU = torch.device("cpu")


def _step(meter: StepMeter, per_layer: list[list[int]]) -> None:
    tally = meter.begin(0.0)
    for layer, ids in enumerate(per_layer):
        tally.computed(torch.tensor(ids, dtype=torch.int64).view(-1, 1), layer)
    meter.end(tally, 0, (), len(per_layer), 0, 0.0)


def test_the_window_keeps_the_last_steps_per_layer() -> None:
    meter = StepMeter(CPU, num_experts=4, records=8, moe_layers=2, window_size=3)
    assert meter.window_load() == [[0] * 4, [0] * 4]
    _step(meter, [[0, 0, 1], [3]])
    _step(meter, [[2], [3, 3]])
    assert meter.window_load() == [[2, 1, 1, 0], [0, 0, 0, 3]]
    _step(meter, [[1], []])
    _step(meter, [[], [0]])  # the first step leaves the window
    assert meter.window_load() == [[0, 1, 1, 0], [1, 0, 0, 2]]
    assert meter.expert_tokens.tolist() == [2 + 1, 1 + 1, 1, 3 + 0]  # cumulative, over layers: unchanged
    assert StepMeter(CPU, num_experts=0, records=8).window_load() == []


def test_a_serving_rank_counts_each_layers_routed_rows(tmp_path: Path) -> None:
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    stack = load_ffn_stack(checkpoint, torch.float32, CPU)
    channel = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    runtime = FFNRuntime(stack, channel, torch.float32, poll_s=0.05, batch_window_s=0.001, load_window=2)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    try:
        peer = AttentionChannel(channel.address, 0, 0, "gloo", timeout_s=30)
        generator = torch.Generator().manual_seed(0)
        expected: list[list[torch.Tensor]] = []
        with torch.inference_mode():
            for tokens in (5, 3, 4):
                hidden = torch.randn(tokens, stack.hidden_size, generator=generator)
                peer.send_header(tokens)
                step = []
                for layer, block in enumerate(stack.layers):
                    inputs = hidden * (layer + 1)
                    peer.exchange(inputs)
                    if isinstance(block, MoE):
                        ids = block.route(inputs).ids.flatten()
                        step.append(torch.bincount(ids, minlength=block.spec.num_experts))
                expected.append(step)
        deadline = time.monotonic() + 10
        while runtime.stats.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        peer.close()
    finally:
        runtime.stop()
        loop.join(10)
    assert runtime.stats.steps == 3
    last_two = [(a + b).tolist() for a, b in zip(expected[1], expected[2], strict=True)]  # window of 2 steps
    assert runtime.meter.window_load() == last_two
    assert len(last_two) == len(stack.moe_blocks) == 2
