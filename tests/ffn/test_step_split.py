"""The FFN step split (`FFNStats.split`) of a real FFN runtime on CPU.

One attention peer (an `AttentionChannel` in this process, `shm`) runs steps of the
tiny Llama's 2 FFN layers with known sleeps: `LAYER_GAP_S` before layer 1 (attention
work between layers) and `STEP_GAP_S` before each step header (work between steps).
The split must put the first in `attention_s`, the second in `idle_s`, add up to the
steps' intervals as the peer saw them, and leave out a step after a pause longer
than `timeline.IDLE_GAP_S`.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.ffn.model import FFNStack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.observability.stats import FFNStats
from afd_ray.observability.timeline import IDLE_GAP_S

LAYER_GAP_S = 0.02
STEP_GAP_S = 0.03
STEPS = 10


@pytest.fixture
def runtime(stack: FFNStack):
    channel = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    ffn = FFNRuntime(stack, channel, torch.float32, poll_s=0.05, batch_window_s=0.05)
    loop = threading.Thread(target=ffn.run)
    loop.start()
    yield ffn
    ffn.stop()
    loop.join(10)


def _steps(runtime: FFNRuntime, channel: AttentionChannel, steps: int) -> list[float]:
    """Run `steps` steps with the module's gaps; returns when each step's last F2A
    arrived (`time.perf_counter()`)."""
    hidden = torch.randn(4, runtime.model.hidden_size)
    done = []
    with torch.inference_mode():
        for _ in range(steps):
            time.sleep(STEP_GAP_S)
            channel.send_header(hidden.shape[0])
            for layer in range(runtime.model.num_layers):
                if layer > 0:
                    time.sleep(LAYER_GAP_S)
                channel.exchange(hidden)
            done.append(time.perf_counter())
    return done


def _settled(runtime: FFNRuntime, steps: int) -> FFNStats:
    """The runtime's counters once it counted `steps` steps (bounded wait)."""
    deadline = time.monotonic() + 10
    while runtime.stats.steps < steps and time.monotonic() < deadline:
        time.sleep(0.01)
    return runtime.stats


def test_the_split_of_each_step_adds_up_and_puts_each_gap_in_its_part(runtime: FFNRuntime) -> None:
    assert runtime.model.num_layers == 2
    channel = AttentionChannel(runtime.channel.address, 0, 0, "shm", timeout_s=30)
    done = _steps(runtime, channel, STEPS)
    stats = _settled(runtime, STEPS)
    channel.close()

    assert stats.steps == STEPS
    split = stats.split
    assert split.steps == STEPS - 1  # the first step has no previous end
    parts = (split.attention_s, split.wire_s, split.ffn_s, split.idle_s)
    assert min(parts) >= 0 and split.ffn_s > 0
    # The FFN rank's intervals end when its last F2A went out, the peer's when it
    # arrived: the two sums differ only by the delivery jitter of the first and last step.
    assert sum(parts) == pytest.approx(done[-1] - done[0], abs=0.05)
    timed = STEPS - 1
    assert split.attention_s >= timed * LAYER_GAP_S
    assert split.idle_s >= timed * STEP_GAP_S
    # The gap between layers is the attention rank's, not the FFN's, nor idle.
    assert split.ffn_s < timed * LAYER_GAP_S / 2
    assert split.attention_s < timed * (LAYER_GAP_S + STEP_GAP_S)


def test_a_step_after_a_pause_starts_no_interval(runtime: FFNRuntime) -> None:
    channel = AttentionChannel(runtime.channel.address, 0, 0, "shm", timeout_s=30)
    _steps(runtime, channel, 3)
    before = _settled(runtime, 3)
    time.sleep(3 * IDLE_GAP_S)
    _steps(runtime, channel, 3)
    after = _settled(runtime, 6)
    channel.close()

    assert before.split.steps == 2
    assert after.split.steps == 4  # the first step after the pause is not timed
    # The pause is in no part: the 2 new timed steps' idle is about STEP_GAP_S each.
    assert after.split.idle_s - before.split.idle_s < 2 * IDLE_GAP_S
