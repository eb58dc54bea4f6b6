"""The device timeline of both roles: profiler traces of the attention engine and of an
FFN rank over the same decode steps, merged onto one clock (Chrome trace JSON, opens in
Perfetto or chrome://tracing).

- **Attention rank**: vLLM's own engine profiler, configured by the engine argument
  `profiler_config` (`vllm_profiler_config`, passed through `attention.engine_args`)
  and started with `AsyncLLM.start_profile()`. Its worker steps it at every
  `execute_model` (`Worker.annotate_profile`, vLLM 0.26 and 0.32): it records from
  `delay_iterations` steps after the start for `max_iterations` steps, then writes
  `<worker name>.<ms>.pt.trace.json` into `torch_profiler_dir` (`stop_profile()` writes
  a shorter one earlier). On CUDA it records CPU and CUDA activities
  (`Worker.profile`), on CPU the CPU ones.
- **FFN rank**: `DeviceTrace`, torch's profiler in the FFN loop's own thread, armed
  from any thread (`request`), started and stopped by the loop at its step boundaries
  (`tick`): it records the `steps` FFN steps after the first `delay`.
- **Merge** (`merge_traces`): Kineto writes each event's `ts` in microseconds from the
  trace's `baseTimeNanoseconds` (the host's wall clock, nanoseconds since the epoch;
  CUDA activity is converted to it by CUPTI), so traces of processes on one host are
  put on one clock by shifting each by the difference of the bases. Pids are
  renumbered per trace and named after it: the GPU rows of two processes on one GPU
  carry the same Kineto device pid.

Off by default: nothing is recorded until a trace is requested; a request records a
bounded number of steps, `finish()` ends it early, `close()` drops it.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

__all__ = ["STEP", "DeviceTrace", "MergedTrace", "merge_traces", "read_trace", "vllm_profiler_config"]


STEP = "afd_ray.ffn_step"
"""The span `DeviceTrace.step` marks each recorded FFN step with."""


def vllm_profiler_config(folder: Path, steps: int, delay: int) -> dict[str, object]:
    """vLLM's `profiler_config` engine argument (`vllm.config.ProfilerConfig`) that records
    `steps` engine steps, `delay` steps after `AsyncLLM.start_profile()`, into `folder`
    (absolute), as an uncompressed Chrome trace; no stacks, no summary table, no trace
    of the front-end process (`ignore_frontend`)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(folder.resolve()),
        "delay_iterations": delay,
        "max_iterations": steps,
        "ignore_frontend": True,
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False,
        "torch_profiler_dump_cuda_time_total": False,
    }


@dataclass(frozen=True)
class _Request:
    path: Path
    steps: int
    delay: int


class DeviceTrace:
    """A torch profiler trace of one loop thread's next steps (the FFN rank's).

    `request` (any thread) arms it; the loop calls `tick(stepped)` after every
    iteration: once `delay` steps passed it starts the profiler (CPU activity, and CUDA
    on a CUDA device), and after `steps` more it stops it and writes the Chrome trace
    to the requested path (`written`). `finish()` (any thread) makes the next tick end
    the trace at once, writing what it recorded. Profiler calls run in the loop thread
    only. `step()` marks each recorded step in the trace (`record_function`).

    Args:
        device: the loop's device.
    """

    def __init__(self, device: torch.device) -> None:
        self._activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._lock = threading.Lock()
        self._asked: _Request | None = None
        self._finish = False
        self._active: _Request | None = None
        self._profile: torch.profiler.profile | None = None
        self._seen = 0
        self.written: Path | None = None
        """The trace file of the last request, once written (None before)."""

    def request(self, path: Path, steps: int, delay: int = 0) -> None:
        """Record the `steps` steps after the next `delay` into `path` (Chrome trace JSON);
        replaces a request not yet finished (its trace is dropped).

        Raises:
            ValueError: `steps` < 1 or `delay` < 0.
        """
        if steps < 1 or delay < 0:
            raise ValueError(f"device trace: steps {steps} must be >= 1 and delay {delay} >= 0")
        with self._lock:
            self._asked, self._finish = _Request(path, steps, delay), False
            self.written = None

    def finish(self) -> None:
        """End the trace at the loop's next tick, writing what it recorded (nothing if it
        had not started)."""
        with self._lock:
            self._finish = True

    @property
    def pending(self) -> bool:
        """A requested trace is not yet written or dropped."""
        with self._lock:
            return self._asked is not None or self._active is not None

    def tick(self, stepped: bool) -> None:
        """After a loop iteration (`stepped`: it ran a step); loop thread only."""
        with self._lock:
            asked, self._asked = self._asked, None
            finish, self._finish = self._finish, False
            dropped = self._profile if asked is not None else None
            if asked is not None:
                self._active, self._profile, self._seen = asked, None, 0
        if dropped is not None:
            dropped.stop()
        active = self._active
        if active is None:
            return
        self._seen += stepped
        if finish or self._seen >= active.delay + active.steps:
            self._end(write=True)
        elif self._profile is None and self._seen >= active.delay:
            self._profile = torch.profiler.profile(activities=self._activities)
            self._profile.start()

    def step(self) -> AbstractContextManager[object]:
        """A span around one step in the trace (nothing while not recording)."""
        return nullcontext() if self._profile is None else torch.profiler.record_function(STEP)

    def close(self) -> None:
        """Stop recording without writing; loop thread only."""
        self._end(write=False)

    def _end(self, write: bool) -> None:
        """Stop the profiler, with `write` writing its trace, and end the request."""
        profile, active = self._profile, self._active
        if profile is not None and active is not None:
            profile.stop()
            if write:
                active.path.parent.mkdir(parents=True, exist_ok=True)
                profile.export_chrome_trace(str(active.path))
                self.written = active.path
        with self._lock:
            self._profile, self._active = None, None


def read_trace(path: Path) -> dict:
    """A Chrome trace JSON file (gzip when its name ends in `.gz`)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


@dataclass(frozen=True)
class MergedTrace:
    """What `merge_traces` wrote: per source label, its events' span on the merged clock."""

    path: Path
    spans_us: Mapping[str, tuple[float, float]]
    """label -> (first, last) event time of its complete events (`ph` X), microseconds
    from the merged trace's `baseTimeNanoseconds`."""
    events: Mapping[str, int]
    """label -> its complete events."""

    def overlap_us(self) -> float:
        """Microseconds during which every source has events (<= 0: none)."""
        return min(end for _, end in self.spans_us.values()) - max(start for start, _ in self.spans_us.values())


def merge_traces(sources: Mapping[str, Path], out: Path) -> MergedTrace:
    """Merge the Chrome traces `sources` (label -> Kineto trace file) into one at `out`,
    on the clock of the first (module docstring); each source's processes are renamed
    `<label>: <their name>`.

    Raises:
        ValueError: a source has no `baseTimeNanoseconds` (not a Kineto trace) or no events.
    """
    merged: list[dict] = []
    spans: dict[str, tuple[float, float]] = {}
    counts: dict[str, int] = {}
    base_ns: int | None = None
    for index, (label, path) in enumerate(sources.items()):
        trace = read_trace(path)
        if "baseTimeNanoseconds" not in trace or not trace.get("traceEvents"):
            raise ValueError(f"{path}: not a Kineto trace with events (no baseTimeNanoseconds or traceEvents)")
        base_ns = trace["baseTimeNanoseconds"] if base_ns is None else base_ns
        shift_us = (trace["baseTimeNanoseconds"] - base_ns) / 1e3
        pids: dict[object, int] = {}
        times: list[float] = []
        for event in trace["traceEvents"]:
            event = dict(event)
            event["pid"] = pids.setdefault(event.get("pid"), (index + 1) * 1000 + len(pids))
            if event.get("ph") in ("s", "t", "f") and "id" in event:  # flows: ids of one source only
                event["id"] = f"{index}:{event['id']}"
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            if event.get("ph") == "X":
                times += (event["ts"], event["ts"] + float(event.get("dur", 0)))
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": f"{label}: {event.get('args', {}).get('name', '')}"}
            merged.append(event)
        if not times:
            raise ValueError(f"{path}: no complete events")
        spans[label], counts[label] = (min(times), max(times)), len(times) // 2
    out.parent.mkdir(parents=True, exist_ok=True)
    # `afd_sources`: the labels in order; source i's pids are (i + 1) * 1000 + k
    document = {"baseTimeNanoseconds": base_ns, "displayTimeUnit": "ms", "afd_sources": list(sources)}
    out.write_text(json.dumps(document | {"traceEvents": merged}))
    return MergedTrace(out, spans, counts)
