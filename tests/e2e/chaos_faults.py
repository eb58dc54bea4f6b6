"""The faults of the chaos tests (`test_chaos.py`) and what they measure: the app's
settings and bounds, the greedy streams and their token times, the processes of a
deployment, the signals, `/afd/status` reads, and the pause of a stream around a fault."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

NAME = "chaos"

PREFIX = f"/{NAME}"

PROMPTS = ["The quick brown fox", "def main():", "Hello, my name is", "import os"]

MAX_TOKENS = 64

MAX_MODEL_LEN = 512

KILLS = 2

WHOLE_WITHIN_S = 300
"""Cap on waiting for a whole layout where a test only needs one (not a bound it asserts)."""

PAUSE_WITHIN_S = 20.0
"""Bound on the pause of a stream through an FFN SIGKILL without a standby rank (1A:1F)
on the 2-core CI machine: Serve finds the replica dead at its next health check (every
0.5 s), starts a replacement (a new process that imports torch, transformers and
afd_ray, then loads its shard), the coordinator re-forms the layout and the attention
rank repeats its layer there. Issue 33 asks for 10 s: measured 7.2-11.3 s on the 2-core
machine, 5.9-9.3 s of it the replacement's imports (docs/failures.md,
benchmarks/results/cpu-2026-12-07-ffn-recovery-breakdown.json); only a standby rank
avoids them."""

FFN_WHOLE_WITHIN_S = 40.0
"""Bound on the layout being whole again after an FFN SIGKILL (from the kill)."""


EP2_PAUSE_WITHIN_S = 30.0
"""Bound on the pause through an FFN SIGKILL at 2A:2F EP2: as at 1A:1F, plus the
survivor's failed EP collective, and the EP group re-formed with the replacement."""


EP2_WHOLE_WITHIN_S = 60.0
"""Bound on 2A:2F EP2 being whole again after that kill (from the kill)."""

MID_RECOVERY_PAUSE_WITHIN_S = 45.0
"""Bound on the pause when the coordinator is killed in the middle of an FFN recovery
(2A:2F EP2): Serve restarts the coordinator (a new process), the members rejoin it,
then the recovery runs again."""

MID_RECOVERY_WHOLE_WITHIN_S = 90.0
"""Bound on the layout being whole again after that double fault (from the FFN kill)."""

UNAFFECTED_PAUSE_WITHIN_S = 5.0
"""Bound on the longest gap of streams through a coordinator SIGKILL: the data path
bypasses the coordinator, so the streams only share the cores with its restart."""

RESUME_PAUSE_WITHIN_S = 10.0
"""Bound on the pause of streams moved to another attention rank after theirs was
SIGKILLed: up to 5 moves after 0.5 s x the attempt number, then the re-prefill."""

ATTENTION_WHOLE_WITHIN_S = 90.0
"""Bound on 2A:2F being whole again after an attention SIGKILL: Serve's replacement
rank starts its vLLM engine."""

HEARTBEAT_S = 15
"""`ffn.heartbeat_timeout_s` of the app: how long the SIGSTOP test stops an FFN rank
(the 30 s default guards a loading SmolLM2 rank on a loaded machine; this app's ranks
load a tiny model)."""

STOPPED_PAST_S = 10
"""How long the SIGSTOP test keeps the FFN rank stopped past `HEARTBEAT_S`: the
coordinator checks every 0.5 s (`WATCH_PERIOD_S`); the rest is margin for a loaded
machine."""

STOPPED_READ_WITHIN_S = 3.0
"""Bound on one read of `/afd/status`, or of the coordinator through its Serve handle,
while an FFN rank is stopped (SIGSTOP)."""

REPLACED_WITHIN_S = 60
"""Bound on Serve replacing a fenced FFN replica after SIGCONT: its next report (0.2 s)
fences it, and 3 failed health checks (every 0.5 s) make Serve replace it."""


@dataclass
class _Result:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str | None = None
    status: int = 0


def _stream(http: httpx.Client, prompt: int, result: _Result) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPTS[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = f"{response.status_code} retry-after={response.headers.get('retry-after')}"
            return
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.error = event["error"]["message"]
                continue
            ids = event["choices"][0].get("token_ids") or []
            result.tokens += ids
            result.times += [time.monotonic()] * len(ids)


def _wait_tokens(results: list[_Result], within_s: float = 60) -> None:
    """Until every stream has its first 2 tokens (bounded)."""
    deadline = time.monotonic() + within_s
    while not all(len(r.tokens) >= 2 for r in results):
        assert time.monotonic() < deadline, results
        time.sleep(0.01)


def _pids(deployment: str) -> list[int]:
    """The process ids of the RUNNING replicas of `deployment`, from Serve's controller
    (the replica details `serve status` shows)."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_deployment_details.remote(NAME, deployment))
    return sorted(r.pid for r in details.replicas if r.state.value == "RUNNING")


def _pid(deployment: str) -> int:
    """The process id of the one replica of `deployment`."""
    (pid,) = _pids(deployment)
    return pid


def _status(http: httpx.Client) -> dict | None:
    """`/afd/status`, or None while it cannot be read (the coordinator restarting)."""
    try:
        response = http.get("/afd/status")
    except httpx.HTTPError:
        return None
    status = response.json() if response.status_code == 200 else None
    return status if isinstance(status, dict) and "epoch" in status else None


STATUS_WITHIN_S = 30
"""Bound on reading `/afd/status` where a test needs it: a 503 (the coordinator did not
answer within the ingress's bound) is read again until then."""


def _read_status(http: httpx.Client) -> dict:
    """`/afd/status`, read again while it answers 503, within `STATUS_WITHIN_S`; the
    failure names each deployment's replica pids (to tell which process stalled)."""
    deadline = time.monotonic() + STATUS_WITHIN_S
    while (status := _status(http)) is None:
        pids = {d: _pids(d) for d in ("coordinator", "ingress", "attention", "ffn")}
        assert time.monotonic() < deadline, f"/afd/status unreadable for {STATUS_WITHIN_S} s; replica pids {pids}"
        time.sleep(0.5)
    return status


def _whole(http: httpx.Client) -> bool:
    status = _status(http)
    if status is None:
        return False
    layout = {
        m["rank"]
        for m in status["ffn"]
        if m["state"] == "ready" and m["ep_rank"] is not None and m["loop"] == "serving"
    }
    attention = [m for m in status["attention"] if m["state"] != "gone"]
    return (
        len(layout) == status["target_ffn"]
        and len(attention) == status["target_attention"]
        and all(
            m["state"] == "ready"
            and m["ffn_peer"] in layout
            and m["peered_epoch"] is not None
            and m["peered_epoch"] >= m["epoch"]
            for m in attention
        )
    )


def _pause_s(results: list[_Result], fault_at: float, paused: bool = True) -> float:
    """The pause through a fault at monotonic `fault_at`: the longest gap between two
    tokens of any stream. Asserts that the fault landed mid-stream: every stream has
    tokens before and after it; with `paused` (a fault every stream waits through),
    each stream's longest gap ends after the fault, with tokens before and after it."""
    for i, result in enumerate(results):
        assert result.times[0] < fault_at < result.times[-1], (i, "not mid-stream", fault_at, result.times)
        if paused:
            _, k = max((b - a, k) for k, (a, b) in enumerate(zip(result.times, result.times[1:])))
            assert result.times[k + 1] > fault_at, (i, "the longest gap ended before the fault", result.times)
    return max(b - a for r in results for a, b in zip(r.times, r.times[1:]))


def _sigkill(chaos: httpx.Client, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _stop_past_heartbeat(chaos: httpx.Client, pid: int) -> None:
    """SIGSTOP FFN process `pid` for `ffn.heartbeat_timeout_s` + `STOPPED_PAST_S`, then
    SIGCONT it; the coordinator must have found it dead meanwhile (a recovery event,
    read once it is resumed), and Serve must stop running it: its next report tells
    it that it was removed, it stops serving and fails its health check. Before
    fencing it kept its replica, its loop and its attention pair under its old epoch,
    and no replacement started.

    While the rank is stopped, `/afd/status` and the coordinator (its Serve handle)
    are read every second, and each read must answer within `STOPPED_READ_WITHIN_S`:
    no call from a stopped member may hold the coordinator."""
    recoveries = len(_read_status(chaos)["recoveries"])
    coordinator = serve.get_deployment_handle("coordinator", NAME)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    reads: list[tuple[float, str, float]] = []  # (since the stop, what answered, seconds taken)

    def read(what: str, call: Callable[[], object]) -> None:
        start = time.monotonic()
        try:
            answer = call()
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            answer = type(exc).__name__
        reads.append((round(start - stopped, 1), f"{what}: {answer}", round(time.monotonic() - start, 2)))

    try:
        while time.monotonic() - stopped < HEARTBEAT_S + STOPPED_PAST_S:
            read("http", lambda: chaos.get("/afd/status", timeout=STOPPED_READ_WITHIN_S).status_code)
            read("handle", lambda: type(coordinator.status.remote().result(timeout_s=STOPPED_READ_WITHIN_S)).__name__)
            time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    answered = {"http: 200", "handle: AFDStatus"}
    assert all(what in answered and took <= STOPPED_READ_WITHIN_S for _, what, took in reads), reads
    deadline = time.monotonic() + STATUS_WITHIN_S
    while len(_read_status(chaos)["recoveries"]) == recoveries:
        assert time.monotonic() < deadline, "the stopped FFN rank was not found dead"
        time.sleep(0.5)
    resumed = time.monotonic()
    while pid in _pids("ffn"):
        assert time.monotonic() - resumed < REPLACED_WITHIN_S, _status(chaos)
        time.sleep(0.5)


def _kill_ffn(
    chaos: httpx.Client,
    reference: list[list[int]],
    pid: int,
    fault: Callable[[httpx.Client, int], None] = _sigkill,
    pause_within_s: float = PAUSE_WITHIN_S,
    whole_within_s: float = FFN_WHOLE_WITHIN_S,
) -> dict:
    """`fault` FFN process `pid` (SIGKILL it) while 4 greedy streams run; check that
    each equals the unfailed run, that the fault landed mid-stream, that the pause is
    at most `pause_within_s`, that the layout is whole again within `whole_within_s`
    of the fault and that the lost rank is then no longer listed; returns the figures."""
    recoveries = len(_read_status(chaos)["recoveries"])
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(chaos, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    killed = time.monotonic()
    fault(chaos, pid)
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for prompt, result in enumerate(results):  # a pause, not a request: all complete, none repeated
        assert result.error is None and result.tokens == reference[prompt], (prompt, result)
    refused = []
    while not _whole(chaos):
        assert time.monotonic() - killed < WHOLE_WITHIN_S, _status(chaos)
        probe = chaos.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        if probe.status_code != 200:
            refused.append(probe)
        time.sleep(1)
    whole_s = time.monotonic() - killed
    assert all(r.status_code == 503 and r.headers.get("retry-after") for r in refused), [
        (r.status_code, r.text[:200]) for r in refused
    ]
    pause_s = _pause_s(results, killed)
    after = _Result()
    _stream(chaos, 0, after)
    assert after.error is None and after.tokens == reference[0], after
    status = _read_status(chaos)
    assert len(status["recoveries"]) == recoveries + 1, status["recoveries"]
    event = status["recoveries"][-1]
    assert event["error"] is None and event["whole_s"] is not None, event
    assert not set(event["lost"]) & {m["rank"] for m in status["ffn"]}, status["ffn"]  # listed only while recovering
    # the event splits the time: detection (`since_report_s`), then FFN layout serving again (`whole_s`)
    assert pause_s <= pause_within_s and whole_s <= whole_within_s, (pause_s, whole_s, event)
    return {
        "lost": event["lost"],
        "completed": sum(r.error is None for r in results),
        "ended_with_error": sum(r.error is not None for r in results),
        "max_gap_s": round(pause_s, 3),
        "detected_after_s": round(event["since_report_s"], 3),
        "cause": event["cause"],
        "ffn_layout_back_s": round(event["whole_s"], 1),
        "whole_s": round(whole_s, 1),
        "bytes_reloaded": event["bytes_loaded"],
        "refused_503": len(refused),
    }


def _membership(status: dict) -> dict:
    """What a restarted coordinator must rebuild from its members: the epoch, the live
    attention ranks with their FFN peers and epochs, and the FFN layout."""
    keys = ("rank", "state", "ffn_peer", "epoch")
    return {
        "epoch": status["epoch"],
        "attention": [{k: m[k] for k in keys} for m in status["attention"] if m["state"] != "gone"],
        "layout": [
            (m["rank"], m["ep_rank"]) for m in status["ffn"] if m["ep_rank"] is not None and m["state"] != "gone"
        ],
    }


REJOIN_WITHIN_S = 120


def _scale_to_2a2f(chaos: httpx.Client) -> None:
    """Resize to 2A:2F (EP2 over the two FFN ranks) unless there already, and wait
    (bounded) until the layout is whole."""
    status = _read_status(chaos)
    if (status["target_attention"], status["target_ffn"]) != (2, 2):
        response = chaos.post("/afd/scale", json={"attention": 2, "ffn": 2}, timeout=600)
        assert response.status_code == 200 and response.json()["error"] is None, response.text
    deadline = time.monotonic() + WHOLE_WITHIN_S
    while not _whole(chaos):
        assert time.monotonic() < deadline, _status(chaos)
        time.sleep(0.5)


def greedy_reference(checkpoint: str) -> list[list[int]]:
    """Plain vLLM's greedy ids of each prompt (`MAX_TOKENS`, EOS ignored), in this
    process: computed before an app starts (one engine at a time on 2 cores)."""
    from vllm import SamplingParams

    from plain_engine import plain_llm

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with plain_llm(checkpoint, MAX_MODEL_LEN, 1 << 27) as llm:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]


def app_args(checkpoint: str, attention_ranks: int, ffn: dict[str, object]) -> dict[str, object]:
    """The chaos app's settings (tiny model, up to 2A:2F): `attention_ranks` to start,
    `ffn` the FFN section's keys besides `max_ranks` and `bundle_resources`."""
    return {
        "model": {"source": checkpoint, "served_name": "tiny", "max_model_len": MAX_MODEL_LEN},
        "attention": {
            "num_ranks": attention_ranks,
            "max_ranks": 2,
            "kv_cache_gib": 0.125,
            "max_num_seqs": 8,
            "bundle_resources": 0.5,
        },
        "ffn": {"max_ranks": 2, "bundle_resources": 0.5, **ffn},
        "connector": {"timeout_s": 60},
    }


@contextmanager
def deployed(serve_url: str, args: dict[str, object]) -> Iterator[httpx.Client]:
    """The app of `args` at `PREFIX` (externally scaled), deleted on exit; a client of it."""
    from afd_ray.serve.app import build_app

    serve.run(build_app(args), name=NAME, route_prefix=PREFIX, external_scaler_enabled=True)
    try:
        with httpx.Client(base_url=serve_url + PREFIX, timeout=120) as http:
            yield http
    finally:
        serve.delete(NAME)
