"""Chaos: SIGKILL the FFN replica's process while greedy streams run, twice in a row,
and the service comes back by itself; SIGKILL the coordinator and serving goes on;
SIGSTOP the FFN replica's process past `ffn.heartbeat_timeout_s`, then SIGCONT: the
coordinator removed it meanwhile, so it is fenced and replaced; then, scaled to 2A:2F
(EP2 over the two FFN ranks), SIGKILL one of the two FFN ranks, then one FFN rank and
the coordinator in the middle of its recovery, and SIGKILL one of the two attention
replicas: its streams resume on the other (a tiny Qwen3-MoE, float32, real Ray
cluster, real vLLM, real HTTP; one app for all, the tests run in this order).

What is checked, per FFN kill:
- a pause, not a request: every stream completes with exactly the tokens of the
  unfailed run (none lost, none repeated, no error); the attention rank blocked in
  the forward pass waits for its new FFN peer and repeats the current layer there;
  with EP the surviving FFN rank re-forms the EP group with the replacement under a
  new epoch, keeps its experts, and its attention rank repeats the layer too;
- every refused request during the recovery is a 503 with `Retry-After`;
- the coordinator records the loss (`/afd/status` `recoveries`): how it was found, the
  detection delay, the time until the FFN layout served again, the bytes reloaded;
- the layout is whole again (FFN target serving, the attention ranks READY on live
  FFN peers), `/afd/status` no longer lists the lost rank (the loss stays in
  `recoveries`), and a new request equals the unfailed run.

The bounds are asserted: the fault landed mid-stream (every stream has tokens before
and after its longest gap, and that gap ends after the fault), the pause (the longest
gap between two tokens of a stream) and the time until the layout is whole again.
"The unfailed run" is plain vLLM's greedy output of the same checkpoint (float32),
not an AFD run. The figures are also printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from vllm import SamplingParams

from afd_ray.models.tiny import build_tiny
from afd_ray.serve.app import build_app
from plain_engine import plain_llm

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
on the 2-core CI machine: Serve finds the replica dead,
starts a replacement (a new process that imports torch and vLLM, then loads its
shard), the coordinator re-forms the layout and the attention rank repeats
its layer there. Issue 33 asks for 10 s: most of the pause is the replacement's start,
which only a standby rank avoids."""
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
fences it, and 3 failed health checks (every 2 s) make Serve replace it."""


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-MoE checkpoint (float32) of this module's app."""
    return str(build_tiny("qwen3_moe", tmp_path_factory.mktemp("chaos") / "qwen3_moe"))


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> list[list[int]]:
    """Plain vLLM's greedy ids of each prompt (`MAX_TOKENS`, EOS ignored), in this
    process, computed before the app starts."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with plain_llm(checkpoint, MAX_MODEL_LEN, 1 << 27) as llm:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]


@pytest.fixture(scope="module")
def chaos(serve_url: str, checkpoint: str, reference: list[list[int]]) -> Iterator[httpx.Client]:
    """The app (1A:1F to start, up to 2A:2F), deployed once plain vLLM's reference is
    computed (one engine at a time on the 2-core machine)."""
    args = {
        "model": {"source": checkpoint, "served_name": "tiny", "max_model_len": MAX_MODEL_LEN},
        "attention": {
            "num_ranks": 1,
            "max_ranks": 2,
            "kv_cache_gib": 0.125,
            "max_num_seqs": 8,
            "bundle_resources": 0.5,
        },
        "ffn": {"num_ranks": 1, "max_ranks": 2, "bundle_resources": 0.5, "heartbeat_timeout_s": HEARTBEAT_S},
        "connector": {"timeout_s": 60},
    }
    serve.run(build_app(args), name=NAME, route_prefix=PREFIX, external_scaler_enabled=True)
    try:
        with httpx.Client(base_url=serve_url + PREFIX, timeout=120) as http:
            yield http
    finally:
        serve.delete(NAME)


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


def test_ffn_sigkill_costs_no_hang_and_the_service_comes_back(chaos: httpx.Client, reference: list[list[int]]) -> None:
    figures = [_kill_ffn(chaos, reference, _pid("ffn")) for _ in range(KILLS)]
    print("\nFFN chaos (1A:1F tiny Qwen3-MoE, float32, CPU):")
    for kill, row in enumerate(figures, 1):
        print("  " + json.dumps({"kill": kill} | row))


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


def test_coordinator_sigkill_does_not_stop_serving(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """Serve restarts the coordinator; the members rejoin it with their ranks, peers,
    epochs and layout; the streams running meanwhile complete unchanged."""
    before = _status(chaos)
    assert before is not None and _whole(chaos), before
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(chaos, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pid("coordinator"), signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    assert [r.tokens for r in results] == reference and all(r.error is None for r in results), results
    pause_s = _pause_s(results, killed, paused=False)
    assert pause_s <= UNAFFECTED_PAUSE_WITHIN_S, pause_s
    while True:  # bounded: wait until the members have rejoined the new coordinator
        after = _status(chaos)
        if after is not None and _membership(after) == _membership(before) and _whole(chaos):
            break
        assert time.monotonic() - killed < REJOIN_WITHIN_S, (_membership(before), after and _membership(after))
        time.sleep(0.5)
    rejoined_s = time.monotonic() - killed
    again = _Result()
    _stream(chaos, 1, again)
    assert again.error is None and again.tokens == reference[1], again
    print(f"\ncoordinator SIGKILL: longest gap {pause_s:.2f} s, members rejoined within {rejoined_s:.1f} s")


def test_ffn_sigstop_past_the_heartbeat_is_fenced_and_replaced(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """SIGSTOP the FFN rank during 4 greedy streams until the coordinator found it dead
    by its missed heartbeat, then SIGCONT: it is fenced (it stops serving and fails its
    health check), Serve replaces it, the layout is re-formed with the replacement,
    and every stream equals the unfailed run. Before, the resumed rank kept its
    replica, its loop and its attention pair under its old epoch while `/afd/status`
    listed it `gone`, and 60 s after SIGCONT Serve still ran it."""
    pid = _pid("ffn")
    stopped_s = HEARTBEAT_S + STOPPED_PAST_S  # the streams pause at least this long
    row = _kill_ffn(
        chaos,
        reference,
        pid,
        fault=_stop_past_heartbeat,
        pause_within_s=stopped_s + PAUSE_WITHIN_S,
        whole_within_s=stopped_s + REPLACED_WITHIN_S + FFN_WHOLE_WITHIN_S,
    )
    assert "ffn.heartbeat_timeout_s" in row["cause"], row
    assert pid not in _pids("ffn")
    print("\nFFN SIGSTOP past the heartbeat, then SIGCONT (1A:1F): " + json.dumps(row))


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


def test_ep2_ffn_sigkill_the_survivor_reforms_the_ep_group(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """2A:2F, EP2: SIGKILL one of the two FFN ranks during 4 greedy streams. The
    survivor's EP collective fails: it closes its attention pairs and waits; the
    coordinator re-forms the EP group from the survivor (same EP rank, no reload) and
    the replacement Serve starts (it loads the lost shard) under a new epoch, and
    re-peers both attention ranks; each repeats its current layer there. Meanwhile
    `/afd/status` says the survivor's loop is `ep_lost`, then `serving` again."""
    _scale_to_2a2f(chaos)
    before = _read_status(chaos)
    survivors = {m["rank"]: m["ep_rank"] for m in before["ffn"] if m["state"] == "ready"}
    assert len(survivors) == 2 and sorted(survivors.values()) == [0, 1], before["ffn"]
    loops: dict[int, set[str | None]] = {rank: set() for rank in survivors}
    done = threading.Event()

    def sample() -> None:  # what /afd/status says each FFN rank's loop does, meanwhile
        while not done.wait(0.3):
            for member in (_status(chaos) or {}).get("ffn", []):
                if member["rank"] in loops:
                    loops[member["rank"]].add(member["loop"])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        row = _kill_ffn(
            chaos, reference, _pids("ffn")[0], pause_within_s=EP2_PAUSE_WITHIN_S, whole_within_s=EP2_WHOLE_WITHIN_S
        )
    finally:
        done.set()
        sampler.join()
    (lost,) = row["lost"]
    after = _read_status(chaos)
    ranks = {m["rank"]: m["ep_rank"] for m in after["ffn"] if m["state"] == "ready" and m["ep_rank"] is not None}
    survivor = next(r for r in survivors if r != lost)
    assert len(ranks) == 2 and ranks[survivor] == survivors[survivor], (survivors, ranks)  # kept its experts
    # truthful while its EP group was lost (it said `serving` before), serving again once re-formed
    assert "ep_lost" in loops[survivor], loops
    assert next(m["loop"] for m in after["ffn"] if m["rank"] == survivor) == "serving", after["ffn"]
    print(f"\nFFN chaos (2A:2F EP2 tiny Qwen3-MoE, float32, CPU; EP rank {survivors[lost]} killed):")
    print("  " + json.dumps(row))


def test_ep2_coordinator_sigkill_mid_recovery_reforms_the_layout(
    chaos: httpx.Client, reference: list[list[int]]
) -> None:
    """2A:2F, EP2: SIGKILL one FFN rank during 4 greedy streams, then the coordinator
    as soon as it has recorded the loss (before the re-formed layout switched). The
    restarted coordinator learns from the rejoining survivor its layout and that its
    EP group is lost, records the lost rank, gives Serve's replacement a new id and
    re-forms the layout; every stream equals the unfailed run. Before, the survivor
    alone could not re-form its rejoined layout (the dead EP rank never rejoins), so
    the layout stayed empty and nothing recovered it."""
    _scale_to_2a2f(chaos)
    before = _read_status(chaos)
    known = {m["rank"] for m in before["ffn"]}
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(chaos, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pids("ffn")[0], signal.SIGKILL)
    killed = time.monotonic()
    while True:  # bounded: until the coordinator recorded the loss
        status = _status(chaos)
        if status is not None and len(status["recoveries"]) > len(before["recoveries"]):
            break
        assert time.monotonic() - killed < 60, status
        time.sleep(0.1)
    event = status["recoveries"][-1]
    assert event["whole_s"] is None, event  # the layout did not switch yet
    os.kill(_pid("coordinator"), signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for prompt, result in enumerate(results):
        assert result.error is None and result.tokens == reference[prompt], (prompt, result)
    pause_s = _pause_s(results, killed)
    while not _whole(chaos):
        assert time.monotonic() - killed < WHOLE_WITHIN_S, _status(chaos)
        time.sleep(0.5)
    whole_s = time.monotonic() - killed
    assert pause_s <= MID_RECOVERY_PAUSE_WITHIN_S and whole_s <= MID_RECOVERY_WHOLE_WITHIN_S, (pause_s, whole_s)
    after = _read_status(chaos)
    (lost,) = event["lost"]
    ranks = {m["rank"]: m["ep_rank"] for m in after["ffn"] if m["state"] == "ready"}
    (replacement,) = set(ranks) - known
    assert lost not in ranks and replacement > max(known), (known, ranks)
    reformed = after["recoveries"][-1]  # the restarted coordinator's record of the same loss
    assert reformed["lost"] == [lost] and reformed["error"] is None and reformed["whole_s"] is not None, reformed
    again = _Result()
    _stream(chaos, 2, again)
    assert again.error is None and again.tokens == reference[2], again
    print(
        f"\nFFN + coordinator SIGKILL mid-recovery (2A:2F EP2): FFN rank {lost} lost, replacement rank "
        f"{replacement}; streams equal to the unfailed run, longest gap {pause_s:.1f} s; whole again "
        f"{whole_s:.1f} s after the FFN kill; restarted coordinator's record: {json.dumps(reformed)}"
    )


ATTENTION_STREAMS = 6


def test_attention_sigkill_streams_resume_on_another_rank(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """2A:2F; SIGKILL one attention replica while 6 greedy streams run: the ingress
    moves the killed rank's streams to the other rank (prompt + tokens already sent,
    re-prefilled), and every stream equals the unfailed run, without error or repeat;
    the killed rank's FFN peer drops it mid-step and keeps serving its EP group (no
    FFN recovery); Serve replaces the killed rank and the layout is whole again."""
    _scale_to_2a2f(chaos)
    recoveries = len(_read_status(chaos)["recoveries"])
    resumed_before = _read_status(chaos)["admission"]["resumed"]
    results = [_Result() for _ in range(ATTENTION_STREAMS)]
    threads = [threading.Thread(target=_stream, args=(chaos, i % len(PROMPTS), r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pids("attention")[0], signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for i, result in enumerate(results):
        assert result.error is None and result.tokens == reference[i % len(PROMPTS)], (i, result)
    pause_s = _pause_s(results, killed, paused=False)  # only the killed rank's streams pause
    status = _read_status(chaos)
    resumed = status["admission"]["resumed"] - resumed_before
    deadline = time.monotonic() + WHOLE_WITHIN_S  # Serve's replacement rank READY (no replica left starting)
    while not _whole(chaos):
        assert time.monotonic() < deadline, _status(chaos)
        time.sleep(0.5)
    whole_s = time.monotonic() - killed
    print(
        f"\nattention SIGKILL (2A:2F): {resumed} of {ATTENTION_STREAMS} streams resumed on the other rank, "
        f"all equal to the unfailed run; longest inter-token gap {pause_s:.2f} s; "
        f"FFN recoveries meanwhile: {len(status['recoveries']) - recoveries}; "
        f"2A:2F whole again {whole_s:.1f} s after the kill"
    )
    assert pause_s <= RESUME_PAUSE_WITHIN_S and whole_s <= ATTENTION_WHOLE_WITHIN_S, (pause_s, whole_s)
    assert resumed >= 1  # streams ran on the killed rank (Serve spreads them over both)
    assert len(status["recoveries"]) == recoveries, status["recoveries"][recoveries:]  # no FFN rank was lost
