"""Stalls of a control-plane replica's asyncio event loop, logged with where it is.

The coordinator answers every member's report and poll and every `/afd/status` from
one event loop: one call that blocks that loop (a synchronous round trip, a long
computation) stalls the whole control plane, and from outside it looks like a hung
or dead replica. `LoopWatch` finds such a stall from another thread and logs the loop
thread's stack while it lasts, then how long it lasted.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

__all__ = ["LoopWatch"]

logger = logging.getLogger("ray.serve")


class LoopWatch:
    """Every `period_s`, schedule a no-op on `loop`; if it has not run within
    `threshold_s`, log a warning with the loop thread's stack, and once it has run,
    how long the loop was stalled. Construct it on the loop's thread; it ends once the
    loop is closed (a daemon thread: it never keeps the process alive).

    Args:
        loop: the event loop to watch (its thread is the constructing thread).
        name: names the loop in the log, e.g. "coordinator".
        threshold_s: a stall this long or longer is logged, seconds.
        period_s: time between two checks, seconds.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, name: str, threshold_s: float = 1.0, period_s: float = 0.5
    ) -> None:
        self._loop, self._name = loop, name
        self._loop_thread = threading.get_ident()
        self._threshold_s, self._period_s = threshold_s, period_s
        threading.Thread(target=self._run, name=f"{name}-loop-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._loop.is_closed():
            time.sleep(self._period_s)
            ran = threading.Event()
            scheduled = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop is closed
                return
            if ran.wait(self._threshold_s):
                continue
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)\n"
            logger.warning(
                "%s event loop has run nothing for %.1f s; its thread is at:\n%s",
                self._name,
                time.monotonic() - scheduled,
                stack,
            )
            while not ran.wait(self._period_s):
                if self._loop.is_closed():
                    return
            logger.warning("%s event loop ran again after %.1f s", self._name, time.monotonic() - scheduled)
