"""`--device-trace-steps N`: the device timeline of each measured AFD round.

The AFD deployment's attention engine is started with vLLM's engine profiler
configured (`traced`: the engine argument `profiler_config`, through
`attention.engine_args`); around each measured round `device_trace` starts vLLM's
profiler on the attention rank (`AttentionServer.device_trace`) and a `DeviceTrace` on
the FFN rank (`FFNServer.device_trace`), each recording N steps after the first
`DELAY_STEPS` of the round (past its prefills), then stops both and merges the two
traces onto one clock (`afd_ray.observability.device_trace.merge_traces`) into
`<folder>/<app>/r<repeat>-b<batch>.json`, with where the FFN rank's idle went
(`afd_ray.observability.trace_summary`) in `r<repeat>-b<batch>.summary.json`.

A round traced is slower than one not traced (the profiler's own cost): its figures
are not comparable with untraced runs. With several ranks per pool, one rank of each
(the one Serve routes the call to) is traced.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ray import serve

from afd_ray.bench.config import TRACE_DELAY_STEPS as DELAY_STEPS
from afd_ray.config import AFDConfig
from afd_ray.observability.device_trace import merge_traces, read_trace, vllm_profiler_config
from afd_ray.observability.trace_summary import summarize

__all__ = ["DELAY_STEPS", "device_trace", "traced"]

_WAIT_S = 60.0
"""Bound on each side's stop and trace write, seconds."""


def traced(app: AFDConfig, folder: Path, steps: int) -> AFDConfig:
    """`app` with its attention engines' profiler recording `steps` steps into
    `folder / "attention"` once started (`vllm_profiler_config`)."""
    attention = app.attention
    profiler = {"profiler_config": vllm_profiler_config(folder / "attention", steps, DELAY_STEPS)}
    return app.model_copy(
        update={"attention": attention.model_copy(update={"engine_args": attention.engine_args | profiler})}
    )


@contextmanager
def device_trace(app: str, folder: Path, steps: int, name: str) -> Iterator[None]:
    """Trace `steps` steps of the block's load on application `app`'s attention and FFN
    ranks (deployed with `traced(..., folder, steps)`) and merge the traces into
    `folder / f"{name}.json"`; prints where, and how long both sides' traces overlap.

    Raises:
        RuntimeError: a side wrote no trace (the round ran fewer than `DELAY_STEPS`
            steps, or a side failed to write within `_WAIT_S`).
    """
    attention = serve.get_deployment_handle("attention", app_name=app)
    ffn = serve.get_deployment_handle("ffn", app_name=app)
    ffn_file = folder / "ffn" / f"{name}.json"
    ffn.device_trace.remote(str(ffn_file), steps, DELAY_STEPS).result(timeout_s=_WAIT_S)
    started = time.time()
    attention.device_trace.remote(True).result(timeout_s=_WAIT_S)
    try:
        yield
    finally:
        attention.device_trace.remote(False).result(timeout_s=_WAIT_S)
        written = ffn.device_trace_finish.remote(_WAIT_S).result(timeout_s=2 * _WAIT_S)
    attention_files = [p for p in (folder / "attention").glob("*.pt.trace.json*") if p.stat().st_mtime >= started]
    if not attention_files or written is None:
        raise RuntimeError(
            f"device trace {folder / name}: attention wrote {len(attention_files)} trace(s), FFN {written!r}; "
            f"a round must run more than {DELAY_STEPS} steps"
        )
    newest = max(attention_files, key=lambda p: p.stat().st_mtime)
    merged = merge_traces({"attention rank": newest, "FFN rank": Path(written)}, folder / f"{name}.json")
    summary = summarize(read_trace(merged.path))
    (folder / f"{name}.summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    split = (
        f"FFN idle per step {summary.idle_ms:.3f} ms = host lag {summary.host_lag_ms:.3f} + waiting "
        f"{summary.waiting_ms:.3f} ({summary.steps} steps with device activity)"
        if summary.steps
        else "no idle split: no FFN step with CUDA kernels (the split reads CUDA kernels only)"
    )
    print(
        f"afd_ray.bench: device trace {merged.path}: events {dict(merged.events)}, both sides for "
        f"{merged.overlap_us() / 1e3:.1f} ms; {split}",
        flush=True,
    )
