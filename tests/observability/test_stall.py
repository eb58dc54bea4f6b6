"""LoopWatch: a blocked event loop is logged with the blocking call's stack, and a loop
that keeps running logs nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from afd_ray.observability.stall import LoopWatch


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call inside a coroutine: nothing else runs


async def _watched(blocked_s: float, idle_s: float) -> None:
    LoopWatch(asyncio.get_running_loop(), "test", threshold_s=0.3, period_s=0.1)
    await asyncio.sleep(0.3)
    _block_the_loop(blocked_s)
    await asyncio.sleep(idle_s)


def test_a_blocked_loop_is_logged_with_the_blocking_call(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        asyncio.run(_watched(blocked_s=1.0, idle_s=0.5))
    stalled, resumed = [r.getMessage() for r in caplog.records]
    assert stalled.startswith("test event loop has run nothing for") and "_block_the_loop" in stalled, stalled
    assert resumed.startswith("test event loop ran again after"), resumed
    assert 0.7 <= float(resumed.split("after ")[1].removesuffix(" s")) <= 1.3, resumed


def test_a_running_loop_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        asyncio.run(_watched(blocked_s=0.0, idle_s=1.0))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
