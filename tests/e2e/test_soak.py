"""Soak: mixed streaming and non-streaming greedy load on 2A:2F (a tiny Qwen3-MoE,
float32, EP over the FFN ranks; real Ray cluster, real vLLM, real HTTP) through
`FAULTS` random faults: FFN SIGKILL, FFN SIGSTOP for 20 s, attention SIGKILL,
coordinator SIGKILL, or a resize of the FFN pool (2 <-> 1 ranks).

The faults come from a seeded RNG (the seed is printed): first the five kinds in a
random order, then (with `FAULTS` over 5) random kinds. Each fault waits until the service has settled from
the last (`_settled`: the layout whole at its target and Serve running exactly the
target replicas), since two attention ranks down at once leave no rank to resume a
stream on, then a random 5-10 s more under load, so that it lands at a random point
of the requests in flight (not longer: the seconds between faults were the service
idling settled).

No request is lost. Each one either completes with plain vLLM's greedy tokens, or
ends with an error that docs/failures.md says it may get: a refusal (429 or 503 with
`Retry-After`, before any answer; 503 during an FFN recovery), or, for a non-streaming
completion on a killed attention rank (it cannot move), a 503 with `Retry-After`.
A greedy stream never ends with an error: it moves to the other attention rank.
Anything else (a 500, a cut connection, a hang, a stream without `[DONE]`, other
tokens) counts as lost. At the end the service is whole at its target and answers.
The fault log and the counts are printed (run with -s) and asserted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from chaos_faults import app_args, deployed
from chaos_faults import HEARTBEAT_S, MAX_TOKENS, PREFIX, PROMPTS, _pids, _read_status, _whole

SEED: int | None = None
"""The faults' seed; None draws one (printed). Set the printed one to replay a run."""
FAULTS = 5
"""Faults in all: the five kinds in a random order, then (with more) random ones; the load
runs until the last one settled. 5, not 7, to save CI about 50 s (with 7: 270 requests
completed equal to plain vLLM, more than twice `MIN_COMPLETED`)."""
GAP_S = (5.0, 10.0)
"""Time under load between the service settling from a fault and the next fault."""
STOP_S = 20.0
"""How long the SIGSTOP fault stops an FFN rank."""
CLIENTS = 6
"""Concurrent clients; each sends one request after another, streaming or not at random
(6 on the 2 attention ranks of `max_num_seqs` 8: one rank can take them all while the
other is replaced)."""
SETTLED_WITHIN_S = 300
"""Bound on the service settling after a fault (an attention rank's replacement starts a
vLLM engine on the 2-core machine)."""
REQUEST_S = 150
"""Bound on one request's answer (a stream pauses through a fault and its recovery)."""
MIN_COMPLETED = 100
"""Requests that must complete: the load ran through the faults."""
KINDS = ("ffn_sigkill", "ffn_sigstop", "attention_sigkill", "coordinator_sigkill", "resize")


@pytest.fixture(scope="module")
def soak(serve_url: str, checkpoint: str, reference: list[list[int]]) -> Iterator[httpx.Client]:
    """The chaos app's settings (`test_chaos.py`, the same name), at 2A:2F from the start."""
    with deployed(serve_url, app_args(checkpoint, 2, {"num_ranks": 2, "heartbeat_timeout_s": HEARTBEAT_S})) as http:
        yield http


@dataclass
class _Outcome:
    stream: bool
    kind: str
    """`completed` (plain vLLM's tokens), an allowed error (`refused 503`, `attention
    rank lost 503`, ...), or what made it lost (`lost: ...`)."""


def _refusal(response: httpx.Response) -> str | None:
    """The kind of an allowed error answer (429/503 with `Retry-After`), else None."""
    if response.status_code in (429, 503) and response.headers.get("retry-after"):
        message = response.json()["error"]["message"]  # OpenAI's error shape, else a failure
        return f"{'attention rank lost' if 'attention rank' in message else 'refused'} {response.status_code}"
    return None


def _request(http: httpx.Client, prompt: int, stream: bool, reference: list[list[int]]) -> _Outcome:
    """One greedy completion of `PROMPTS[prompt]` and what became of it."""
    body = {
        "model": "tiny",
        "prompt": PROMPTS[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    try:
        with http.stream("POST", "/v1/completions", json=body, timeout=REQUEST_S) as response:
            if response.status_code != 200:
                response.read()
                refusal = _refusal(response)
                kind = refusal or f"lost: HTTP {response.status_code} {response.text[:160]}"
                return _Outcome(stream, kind)
            if not stream:
                ids = json.loads(response.read())["choices"][0]["token_ids"]
                return _Outcome(stream, "completed" if ids == reference[prompt] else f"lost: tokens {ids}")
            tokens: list[int] = []
            done = False
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        return _Outcome(stream, f"lost: SSE error {event['error']['code']} {event['error']['message']}")
                    tokens += event["choices"][0].get("token_ids") or []
    except httpx.HTTPError as exc:
        return _Outcome(stream, f"lost: {type(exc).__name__} {exc}")
    if not done or tokens != reference[prompt]:
        return _Outcome(stream, f"lost: done={done} tokens {tokens}")
    return _Outcome(stream, "completed")


class _Load:
    """`CLIENTS` threads, each sending one greedy request after another (streaming or
    not, any prompt, at random) until `stop`; a refused one waits its `Retry-After`."""

    def __init__(self, base_url: str, reference: list[list[int]], seed: int) -> None:
        self.outcomes: list[_Outcome] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(base_url, reference, random.Random(seed + i)))
            for i in range(CLIENTS)
        ]
        for thread in self._threads:
            thread.start()

    def _client(self, base_url: str, reference: list[list[int]], rng: random.Random) -> None:
        with httpx.Client(base_url=base_url) as http:
            while not self._stopping.is_set():
                with self._lock:
                    self.in_flight += 1
                stream = rng.random() < 0.5
                try:
                    outcome = _request(http, rng.randrange(len(PROMPTS)), stream, reference)
                except Exception as exc:  # noqa: BLE001 - an answer it could not read: counted as lost
                    outcome = _Outcome(stream, f"lost: {type(exc).__name__} {exc}")
                with self._lock:
                    self.in_flight -= 1
                    self.outcomes.append(outcome)
                if outcome.kind != "completed":
                    time.sleep(1)

    def stop(self) -> None:
        """Stop sending; the requests in flight end first (bounded)."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(REQUEST_S + 30)
        assert not any(thread.is_alive() for thread in self._threads), "a request hung"


def _settled(http: httpx.Client) -> bool:
    """The layout whole at its target, and Serve running exactly the target replicas (a
    fenced or removed replica is gone)."""
    if not _whole(http):
        return False
    status = _read_status(http)
    return len(_pids("attention")) == status["target_attention"] and len(_pids("ffn")) == status["target_ffn"]


def _fault(kind: str, http: httpx.Client, rng: random.Random) -> tuple[str, Callable[[], bool]]:
    """Inject fault `kind`: what it hit, and a test that Serve no longer runs the process
    it hit (killed, or fenced once continued, and replaced; for a resize: at once)."""
    if kind == "resize":
        target = 3 - _read_status(http)["target_ffn"]  # 2 -> 1 -> 2 FFN ranks
        response = http.post("/afd/scale", json={"attention": 2, "ffn": target}, timeout=600)
        assert response.status_code == 200 and response.json()["error"] is None, response.text
        return f"2A:{target}F", lambda: True
    deployment = {"ffn_sigkill": "ffn", "ffn_sigstop": "ffn", "attention_sigkill": "attention"}.get(kind, "coordinator")
    pid = rng.choice(_pids(deployment))
    gone = lambda: pid not in _pids(deployment)  # noqa: E731
    if kind != "ffn_sigstop":
        os.kill(pid, signal.SIGKILL)
        return f"{deployment} pid {pid}", gone
    os.kill(pid, signal.SIGSTOP)  # past `HEARTBEAT_S`: found dead, then fenced once continued
    try:
        time.sleep(STOP_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"ffn pid {pid} for {STOP_S:g} s", gone


def _wait(until: Callable[[], bool], within_s: float, what: str) -> None:
    """Until `until()` (bounded by `within_s`)."""
    start = time.monotonic()
    while not until():
        assert time.monotonic() - start < within_s, what
        time.sleep(0.5)


@pytest.mark.timeout(1500)  # the app's start, the faults and their recoveries
def test_soak_under_random_faults_loses_no_request(
    soak: httpx.Client, serve_url: str, reference: list[list[int]]
) -> None:
    seed = SEED if SEED is not None else random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    print(f"\nsoak: seed {seed}")
    _wait(lambda: _settled(soak), SETTLED_WITHIN_S, "2A:2F did not settle")
    kinds = rng.sample(KINDS, len(KINDS))
    log: list[dict] = []
    load = _Load(serve_url + PREFIX, reference, seed)
    start = time.monotonic()
    try:
        while len(log) < FAULTS:
            time.sleep(rng.uniform(*GAP_S))
            kind = kinds[len(log)] if len(log) < len(KINDS) else rng.choice(KINDS)
            last, in_flight = time.monotonic(), load.in_flight
            hit, gone = _fault(kind, soak, rng)
            _wait(gone, SETTLED_WITHIN_S, f"{kind} ({hit}): Serve still runs it; {log}")
            _wait(lambda: _settled(soak), SETTLED_WITHIN_S, f"{kind} ({hit}): not settled; {log}")
            entry = {"at_s": round(last - start, 1), "fault": kind, "hit": hit, "in_flight": in_flight}
            log.append(entry | {"settled_s": round(time.monotonic() - last, 1)})
            print("  " + json.dumps(log[-1]), flush=True)
    finally:
        load.stop()
    counts = Counter(o.kind for o in load.outcomes)
    lost = {kind: n for kind, n in counts.items() if kind.startswith("lost")}
    errors = {kind: n for kind, n in counts.items() if kind not in lost and kind != "completed"}
    summary = {
        "seed": seed,
        "faults": len(log),
        "sent": len(load.outcomes),
        "completed_equal": counts["completed"],
        "ended_with_error": errors,
        "lost": sum(lost.values()),
        "streams": sum(o.stream for o in load.outcomes),
    }
    print("soak: " + json.dumps(summary))
    assert not lost, (lost, summary, log)
    assert summary["sent"] == summary["completed_equal"] + sum(errors.values()), summary
    assert not any(o.stream and o.kind.startswith("attention rank lost") for o in load.outcomes), summary
    assert summary["completed_equal"] >= MIN_COMPLETED, summary
    assert {e["fault"] for e in log} == set(KINDS) and all(e["in_flight"] > 0 for e in log), log
    status = _read_status(soak)
    assert _settled(soak) and status["target_attention"] == 2, status  # whole at its target
    assert _request(soak, 0, True, reference).kind == "completed"
