"""The device timeline of both roles (`afd_ray.observability.device_trace`).

`DeviceTrace` in a loop thread records exactly the steps asked, after the delay, and
`finish` ends it early; `merge_traces` puts two traces on one clock. End to end, the
benchmark's `--device-trace-steps` is checked in tests/bench/test_bench_smoke.py (its
1A:1F rounds are traced through the product path).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from afd_ray.observability.device_trace import STEP, DeviceTrace, merge_traces, read_trace
from afd_ray.observability.trace_summary import summarize


def _loop(trace: DeviceTrace, steps: int, stop: threading.Event | None = None) -> None:
    """A loop thread: `steps` steps of a matmul, each marked, a tick after each."""
    x = torch.ones(8, 8)
    for _ in range(steps):
        if stop is not None and stop.is_set():
            break
        with trace.step():
            x = x @ torch.ones(8, 8) / 8
        trace.tick(True)
    trace.close()


def _spans(path: Path, name: str = STEP) -> list[dict]:
    return [e for e in read_trace(path)["traceEvents"] if e.get("ph") == "X" and e.get("name") == name]


def test_device_trace_records_the_steps_asked_after_the_delay(tmp_path: Path) -> None:
    trace = DeviceTrace(torch.device("cpu"))
    _loop(trace, 3)  # not requested: nothing recorded
    assert trace.written is None and not trace.pending
    trace.request(tmp_path / "ffn.json", steps=4, delay=2)
    assert trace.pending
    thread = threading.Thread(target=_loop, args=(trace, 12))
    thread.start()
    thread.join(timeout=60)
    assert trace.written == tmp_path / "ffn.json" and not trace.pending
    assert len(_spans(trace.written)) == 4


def test_finish_writes_what_was_recorded(tmp_path: Path) -> None:
    trace = DeviceTrace(torch.device("cpu"))
    trace.request(tmp_path / "ffn.json", steps=1000)
    stop = threading.Event()
    thread = threading.Thread(target=_loop, args=(trace, 10**6, stop))
    thread.start()
    time.sleep(0.2)
    trace.finish()
    deadline = time.monotonic() + 30
    while trace.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=60)
    assert trace.written is not None and 0 < len(_spans(trace.written)) < 1000


def test_request_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps 0 must be >= 1"):
        DeviceTrace(torch.device("cpu")).request(tmp_path / "x.json", steps=0)


def _kineto(path: Path, base_ns: int, pid: int, ts: float) -> Path:
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "name": "op", "pid": pid, "tid": 1, "ts": ts, "dur": 10.0},
    ]
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))
    return path


def test_merge_puts_both_traces_on_one_clock(tmp_path: Path) -> None:
    # the same instant (base + ts) in two traces of different bases; the same Kineto pid
    a = _kineto(tmp_path / "a.json", 1_000_000_000, 0, 500.0)
    b = _kineto(tmp_path / "b.json", 1_000_200_000, 0, 300.0)
    merged = merge_traces({"attention rank": a, "FFN rank": b}, tmp_path / "m.json")
    assert merged.spans_us == {"attention rank": (500.0, 510.0), "FFN rank": (500.0, 510.0)}
    assert merged.overlap_us() == 10.0
    events = read_trace(merged.path)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names.values()) == ["FFN rank: python", "attention rank: python"]  # two pids, named
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a Kineto trace"):
        merge_traces({"x": plain}, tmp_path / "n.json")


def _x(pid: int, name: str, ts: float, dur: float, cat: str, correlation: int | None = None) -> dict:
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur, "cat": cat, "args": args}


def test_summary_splits_the_idle_interval() -> None:
    # FFN (source 2): CPU pid 2000, GPU 2001; attention (source 1) GPU 1001; microseconds
    launches = [(10, 1), (20, 2), (90, 3), (95, 4), (100, 5)]
    gpu = [("wait_signal_kernel", 50, 10, 1), ("put_signal_kernel", 70, 5, 2), ("wait_signal_kernel", 100, 100, 3)]
    gpu += [("fused_moe_kernel", 210, 20, 4), ("put_signal_kernel", 240, 5, 5)]
    events = [_x(2000, STEP, 0, 60, "user_annotation"), _x(2000, STEP, 80, 220, "user_annotation")]
    events += [_x(2000, "cudaLaunchKernel", ts, 1, "cuda_runtime", c) for ts, c in launches]
    events += [_x(2001, name, ts, dur, "kernel", c) for name, ts, dur, c in gpu]
    events += [_x(1001, "lm_head_gemm", 60, 60, "kernel"), _x(1001, "mla_decode", 150, 40, "kernel")]
    summary = summarize({"afd_sources": ["attention rank", "FFN rank"], "traceEvents": events})
    # idle: previous put's end (75) to the first wait's end (200); the wait started at 100
    assert summary.steps == 1
    assert summary.idle_ms == pytest.approx(0.125) and summary.host_lag_ms == pytest.approx(0.025)
    assert summary.waiting_ms == pytest.approx(0.1)
    assert summary.attention_kernels_ms == pytest.approx({"lm_head_gemm": 0.045, "mla_decode": 0.04})
    assert summary.attention_gpu_gap_ms == pytest.approx(0.04)
    # FFN stream idle inside the steps: 60-70 in the first, 200-210 and 230-240 in the second
    assert summary.ffn_stream_gaps_ms == pytest.approx(0.015)
    with pytest.raises(ValueError, match="not a merged trace"):
        summarize({"traceEvents": events})


def test_summary_cli_names_the_file_and_says_when_there_is_no_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It read `sys.argv` by hand: `--help` was opened as a file, a missing or non-JSON
    file gave a traceback (new-user trial); a CPU trace printed zeros as if measured."""
    from afd_ray.observability.trace_summary import main as summary_main

    for bad, says in ((tmp_path / "none.json", "No such file"), (tmp_path / "bad.json", "Expecting value")):
        if bad.name == "bad.json":
            bad.write_text("not json")
        with pytest.raises(SystemExit) as exit_info:
            summary_main([str(bad)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"MERGED: {bad}" in err and says in err, err
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"afd_sources": ["attention rank", "FFN rank"], "traceEvents": []}))
    assert summary_main([str(cpu)]) == 0
    captured = capsys.readouterr()
    assert "CUDA kernels only" in captured.err and json.loads(captured.out)["steps"] == 0
