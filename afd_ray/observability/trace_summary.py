"""Where the FFN rank's idle goes, read from a merged device trace
(`afd_ray.observability.device_trace.merge_traces`, CUDA activity on both sides).

Per traced FFN step (the rank's `afd_ray.ffn_step` spans, after the first) the idle
interval of `afd_ray.observability.timeline` is, on the FFN rank's GPU row: from the end
of the previous step's last F2A `put_signal` kernel to the end of this step's first A2F
`wait_signal` kernel (the rows of its first layer are in). It is split into:

- `host_lag`: before the first `wait_signal` kernel starts: the FFN stream had nothing
  queued, its host was still forming the step (reading the header, setting it up);
- `waiting`: the `wait_signal` kernel spinning: the attention rank had not sent yet.

And what the attention rank's GPU ran meanwhile: its kernels clipped to the interval,
summed by name (lm_head, sampling, input preparation, embedding, layer 0's attention
...), and `attention_gpu_gap`, the part of the interval with no attention kernel on
the GPU (the attention host was late). Kernels are matched to their launches by
Kineto's `correlation` (the FFN loop launches its exchange kernels eagerly).

`python -m afd_ray.observability.trace_summary MERGED.json` prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from afd_ray.observability.device_trace import STEP, read_trace

__all__ = ["GPU_CATEGORIES", "IdleSummary", "summarize"]

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Kineto categories of device activity."""
_TOP = 12
_LAUNCHES = frozenset({"cuda_runtime", "cuda_driver"})
"""Kineto categories of host calls that launch device work (their `correlation` names it)."""


@dataclass(frozen=True)
class IdleSummary:
    """Means per FFN step of the traced steps' idle interval (module docstring), ms."""

    steps: int = 0
    """FFN steps whose idle interval was found (each after a traced step)."""
    idle_ms: float = 0.0
    host_lag_ms: float = 0.0
    waiting_ms: float = 0.0
    attention_gpu_gap_ms: float = 0.0
    """No attention kernel ran during this part of the interval."""
    ffn_stream_gaps_ms: float = 0.0
    """Within the steps (first wait to last put), time the FFN rank's GPU ran nothing:
    its host had not queued the next work (it lands in the split's attention, wire and
    idle parts)."""
    attention_kernels_ms: dict[str, float] = field(default_factory=dict)
    """The attention rank's GPU work during the idle interval, by kernel name (the
    largest, per step)."""


def _interval(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def _covered(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of [start, end] covered by the union of `intervals`."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered


def summarize(trace: dict, ffn: str = "FFN rank", attention: str = "attention rank") -> IdleSummary:
    """The idle summary of a merged trace whose sources are labelled `ffn` and
    `attention` (`afd_sources`); an empty one when it holds no device activity.

    Raises:
        ValueError: the trace is not a merged one of both labels.
    """
    labels = trace.get("afd_sources", [])
    if ffn not in labels or attention not in labels:
        raise ValueError(f"not a merged trace of {ffn!r} and {attention!r}: sources {labels}")

    def source(event: dict) -> str | None:
        index = int(event.get("pid", 0)) // 1000 - 1
        return labels[index] if 0 <= index < len(labels) else None

    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    ffn_events = [e for e in complete if source(e) == ffn]
    ffn_gpu = sorted((e for e in ffn_events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    attention_gpu = [
        _interval(e) + (e["name"],) for e in complete if source(e) == attention and e.get("cat") in GPU_CATEGORIES
    ]
    spans = sorted((_interval(e) for e in ffn_events if e["name"] == STEP))
    launches = [(e["ts"], e.get("args", {}).get("correlation")) for e in ffn_events if e.get("cat") in _LAUNCHES]
    by_correlation = {e.get("args", {}).get("correlation"): e for e in ffn_gpu}

    def kernels_of(span: tuple[float, float]) -> list[dict]:
        found = [by_correlation.get(c) for ts, c in launches if span[0] <= ts <= span[1]]
        return sorted((k for k in found if k is not None), key=lambda k: k["ts"])

    idle = lag = gap = stream_gaps = 0.0
    names: Counter[str] = Counter()
    counted = traced = 0
    previous_put: float | None = None
    for span in spans:
        kernels = kernels_of(span)
        waits = [k for k in kernels if "wait_signal" in k["name"]]
        puts = [k for k in kernels if "put_signal" in k["name"]]
        if not waits or not puts:
            previous_put = None
            continue
        first_wait, last_put = _interval(waits[0]), _interval(puts[-1])
        if previous_put is not None and first_wait[1] > previous_put:
            counted += 1
            idle += first_wait[1] - previous_put
            lag += max(first_wait[0] - previous_put, 0.0)
            clipped = [(max(a, previous_put), min(b, first_wait[1]), n) for a, b, n in attention_gpu]
            clipped = [(a, b, n) for a, b, n in clipped if b > a]
            gap += (first_wait[1] - previous_put) - _covered(
                [(a, b) for a, b, _ in clipped], previous_put, first_wait[1]
            )
            for a, b, n in clipped:
                names[n[:100]] += b - a
        traced += 1
        busy = [_interval(e) for e in ffn_gpu if first_wait[0] <= e["ts"] <= last_put[1]]
        stream_gaps += (last_put[1] - first_wait[0]) - _covered(busy, first_wait[0], last_put[1])
        previous_put = last_put[1]
    if counted == 0:
        return IdleSummary()
    ms = 1e-3 / counted
    return IdleSummary(
        steps=counted,
        idle_ms=idle * ms,
        host_lag_ms=lag * ms,
        waiting_ms=(idle - lag) * ms,
        attention_gpu_gap_ms=gap * ms,
        ffn_stream_gaps_ms=stream_gaps * 1e-3 / traced,
        attention_kernels_ms={name: us * ms for name, us in names.most_common(_TOP)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m afd_ray.observability.trace_summary MERGED.json[.gz]`: print the
    summary as JSON; exit 2 with `error: MERGED: ...` for a file that cannot be read or
    is not a merged trace. A trace without CUDA kernels (a CPU run) has no idle split:
    a line on stderr says so."""
    parser = argparse.ArgumentParser(
        prog="python -m afd_ray.observability.trace_summary",
        description="split the FFN rank's idle per step of a merged device trace (afd_ray.bench "
        "--device-trace-steps) into host lag and waiting; CUDA traces only",
    )
    parser.add_argument("merged", type=Path, help="the merged trace (<app>/r<repeat>-b<batch>.json)")
    args = parser.parse_args(argv)
    try:
        summary = summarize(read_trace(args.merged))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        parser.error(f"MERGED: {args.merged}: {exc}")
    if summary.steps == 0:
        print(
            "no FFN step with CUDA kernels in this trace (a CPU run?): the idle split reads CUDA kernels only",
            file=sys.stderr,
        )
    print(json.dumps(asdict(summary), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
