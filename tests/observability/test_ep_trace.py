"""With EP, `afd-ray trace` shows each FFN rank's compute of the EP step that served a
token, so the straggler rank (the one the others wait for in their EP collectives) is
visible (issue 34, docs/eplb.md)."""

from __future__ import annotations

import time

import pytest
import torch

from afd_ray.observability.cli import format_trace
from afd_ray.observability.meter import StepMeter
from afd_ray.observability.steps import AttentionStep, FFNStep, PeerStep, StepLog

pytestmark = pytest.mark.timeout(30)


def _ffn(peer: int, step_id: int, index: int, compute_s: float, epoch: int = 4) -> FFNStep:
    """FFN step `index` of layout `epoch` serving attention rank `peer`'s step `step_id`."""
    return FFNStep(
        epoch=epoch,
        start_s=0.0,
        peers=(PeerStep(rank=peer, epoch=1, step_id=step_id, num_tokens=2, queue_s=0.0),),
        compute_s=compute_s,
        ep_s=0.001,
        f2a_s=0.0,
        total_s=compute_s + 0.001,
        index=index,
    )


def test_the_meter_numbers_the_steps_of_each_layout_epoch() -> None:
    meter = StepMeter(torch.device("cpu"), num_experts=4, records=16)
    for epoch in (0, 0, 0, 2, 2, 5):
        meter.end(meter.begin(0.0), epoch, (), layers=1, a2f_bytes=0, collective_s=0.0)
    assert [(s.epoch, s.index) for s in meter.steps.records()] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (5, 0)]


def test_the_counters_keep_the_compute_apart_from_the_ep_wait() -> None:
    """`FFNStats.compute_s` / `ep_s` (also in `/afd/status`'s FFN ranks): a step that
    computed 20 ms, 5 ms of it in EP collectives, adds about 15 ms and 5 ms."""
    meter = StepMeter(torch.device("cpu"), num_experts=4, records=16)
    for _ in range(2):
        tally = meter.begin(0.0)
        tally.arrived()
        time.sleep(0.02)
        tally.computed(None)
        tally.sent(0)
        meter.end(tally, 0, (), layers=1, a2f_bytes=0, collective_s=0.005)
    assert meter.stats.ep_s == pytest.approx(0.010)
    assert 0.029 < meter.stats.compute_s < 0.2, meter.stats
    assert meter.stats.compute_s == pytest.approx(sum(s.compute_s for s in meter.steps.records()))


def test_a_token_shows_every_ep_ranks_compute_of_its_step() -> None:
    """Attention ranks 0 and 1 peer with FFN ranks 0 and 1 of one EP2 layout; FFN rank
    1 holds the hot experts and computes 4x longer in every EP step. A token of
    attention rank 0 (served by FFN rank 0) shows both ranks' compute of its step."""
    log = StepLog()
    log.add_attention(
        0,
        [
            AttentionStep(
                rank=0, epoch=1, step_id=i, start_s=10.0 + 0.05 * i, num_tokens=2, exchange_s=0.03, requests=("r-0-x",)
            )
            for i in range(3)
        ],
    )
    log.add_ffn(0, [_ffn(0, step_id=i, index=7 + i, compute_s=0.002) for i in range(3)])
    log.add_ffn(1, [_ffn(1, step_id=40 + i, index=7 + i, compute_s=(0.008, 0.009, 0.010)[i]) for i in range(3)])
    log.add_ffn(1, [_ffn(1, step_id=0, index=7, compute_s=1.0, epoch=3)])  # another layout's step 7
    steps = log.breakdown("r")
    assert [s.step_id for s in steps] == [0, 1]
    assert [s.ffn_rank_compute_s for s in steps] == [{0: 0.002, 1: 0.008}, {0: 0.002, 1: 0.009}]
    assert steps[0].ffn_compute_s == 0.002  # its own FFN peer's part, as before
    table = format_trace("r", [s.model_dump(mode="json") for s in steps])
    assert "slowest FFN rank" in table and table.splitlines()[2].endswith("   1     8.00"), table
    assert table.splitlines()[-1].endswith("rank 0 4.00, rank 1 17.00"), table


def test_without_ep_a_token_shows_no_per_rank_compute() -> None:
    log = StepLog()
    log.add_attention(
        0,
        [
            AttentionStep(rank=0, epoch=1, step_id=i, start_s=float(i), num_tokens=1, exchange_s=0.01, requests=("r",))
            for i in range(2)
        ],
    )
    log.add_ffn(0, [_ffn(0, step_id=i, index=i, compute_s=0.002) for i in range(2)])
    (step,) = log.breakdown("r")
    assert step.ffn_rank_compute_s == {}
    assert "slowest" not in format_trace("r", [step.model_dump(mode="json")])
