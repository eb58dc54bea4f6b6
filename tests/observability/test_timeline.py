"""`StepTimeline` on the CPU clock: sampling one step in N times only that step's own
interval, its parts add up to it, and a gap of the service without work is no step's."""

from __future__ import annotations

import time

import pytest
import torch

from afd_ray.observability.timeline import IDLE_GAP_S, Clock, StepTimeline

GAP_S = 0.004
"""Sleep between two stamps: each part of a step is a known number of gaps."""


def _step(timeline: StepTimeline, layers: int, idle_gaps: int) -> None:
    """One step: `idle_gaps` before layer 0's rows; per layer 2 gaps of compute, 1 of
    wire, and 3 of attention before a later layer's rows."""
    marks = timeline.begin(time.perf_counter())
    time.sleep(idle_gaps * GAP_S)
    for layer in range(layers):
        if layer:
            time.sleep(3 * GAP_S)
        for gaps in (0, 2, 1):
            time.sleep(gaps * GAP_S)
            if marks is not None:
                marks.append(timeline.clock.stamp())
    timeline.end(marks, time.perf_counter())


def test_one_step_in_four_is_timed_over_its_own_interval() -> None:
    timeline = StepTimeline(Clock(torch.device("cpu")), every=4)
    layers = 3
    start = time.perf_counter()
    for _ in range(12):
        _step(timeline, layers, idle_gaps=5)
    elapsed = time.perf_counter() - start
    split = timeline.collect()

    assert split.steps == 3  # steps 4, 8 and 12; step 3, 7, 11 stamp their ends
    parts = (split.attention_s, split.wire_s, split.ffn_s, split.idle_s)
    total = sum(parts)
    assert min(parts) >= 0
    # Three step intervals, not the whole run (sleeps overshoot, never undershoot).
    assert 3 * (5 + 3 * (layers - 1) + 3 * layers) * GAP_S <= total < elapsed / 2
    assert split.ffn_s >= 3 * layers * 2 * GAP_S
    assert split.wire_s >= 3 * layers * GAP_S
    assert split.attention_s >= 3 * (layers - 1) * 3 * GAP_S
    assert split.idle_s >= 3 * 5 * GAP_S
    assert timeline.collect().steps == 0  # each timed step is counted once


def test_rest_drops_the_next_interval() -> None:
    timeline = StepTimeline(Clock(torch.device("cpu")), every=1)
    _step(timeline, 1, idle_gaps=0)
    _step(timeline, 1, idle_gaps=0)
    timeline.rest()
    _step(timeline, 1, idle_gaps=0)
    assert timeline.collect().steps == 1


def test_a_step_after_an_idle_gap_starts_no_interval() -> None:
    timeline = StepTimeline(Clock(torch.device("cpu")), every=1)
    _step(timeline, 1, idle_gaps=0)
    time.sleep(IDLE_GAP_S * 1.2)
    _step(timeline, 1, idle_gaps=0)  # the gap is before its begin: not timed
    _step(timeline, 1, idle_gaps=int(IDLE_GAP_S / GAP_S / 2))  # a gap inside the step counts
    split = timeline.collect()
    assert split.steps == 1 and split.idle_s >= IDLE_GAP_S / 2 - GAP_S


def test_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every: 0 < 1"):
        StepTimeline(Clock(torch.device("cpu")), every=0)
