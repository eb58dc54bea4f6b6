"""Overload, deadlines and access keys through the real application: a tiny Llama
(float32, 1A:1F) with a small admission capacity, an API key and an admin key, over
real HTTP on the session Ray cluster (the `guarded` fixture of tests/serve/conftest.py;
the same deployment is fuzzed by tests/serve/test_fuzz.py).
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from guarded_app import ADMIN, API_KEY, BODY_TIMEOUT_S, CAPACITY, MAX_TOKENS, USER

from afd_ray.serve.app import build_app


def _completion(stream: bool = True, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


@dataclass
class _Answer:
    status: int
    headers_s: float
    """Seconds from sending to the response headers."""
    retry_after: str | None
    tokens: int = 0
    """Generated token ids received (summed over events: one event may carry several)."""
    error: str | None = None
    done: bool = False
    end_s: float = 0.0
    """Seconds from sending to the end of the response body."""


def _send(http: httpx.Client, start: threading.Barrier, answers: list[_Answer], max_tokens: int) -> None:
    start.wait(60)
    sent = time.monotonic()
    with http.stream(
        "POST", "/v1/completions", json=_completion(max_tokens=max_tokens), headers=USER, timeout=120
    ) as response:
        answer = _Answer(response.status_code, time.monotonic() - sent, response.headers.get("retry-after"))
        for line in response.iter_lines():
            if line == "data: [DONE]":
                answer.done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    answer.error = event["error"]["message"]
                elif "choices" in event:
                    answer.tokens += len(event["choices"][0].get("token_ids") or [])
    answer.end_s = time.monotonic() - sent
    answers.append(answer)


def _burst(
    http: httpx.Client, n: int, max_tokens: int
) -> tuple[list[_Answer], list[threading.Thread], threading.Barrier]:
    """`n` streams started together (once the returned barrier's last party, the
    caller, waits on it)."""
    answers: list[_Answer] = []
    start = threading.Barrier(n + 1)
    threads = [threading.Thread(target=_send, args=(http, start, answers, max_tokens)) for _ in range(n)]
    for thread in threads:
        thread.start()
    return answers, threads, start


def _admission(http: httpx.Client) -> dict:
    return http.get("/afd/status").json()["admission"]


def _wait_admission(http: httpx.Client, ok: Callable[[dict], bool], within_s: float = 60) -> dict:
    deadline = time.monotonic() + within_s
    while not ok(state := _admission(http)):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


HOLD_TOKENS = 160
"""Tokens of each stream that holds the capacity while refusals are timed: the first
of them ends seconds after the probes (about 40 ms per step on a loaded 2-core machine)."""
BURSTS = 3
"""Bursts of 5x the capacity whose refusals are timed at the client (to the response
headers). Issue 15's figure, "the 429s come within 100 ms", is a performance claim and
is measured by `benchmarks/refusal_burst.py` (docs/failures.md has its results file);
this test asserts what makes a refusal immediate whatever the machine's speed: the
median refusal comes before the first admitted stream of its burst has finished (24
tokens of decode), so no refusal waits on model compute. It asserted the 100 ms median
until CI on 2026-12-07 measured 117 ms on a busy 2-core machine (a deployment of the
previous module was still being torn down); on a quiet one it was 26-80 ms."""


def _half_a_body(client: httpx.Client) -> bytes:
    """The bytes of a POST /v1/completions to `client`'s server: the headers, and only
    half of the body their `Content-Length` announces."""
    url = client.base_url
    body = json.dumps(_completion(stream=False)).encode()
    head = (
        f"POST {url.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Authorization: {USER['Authorization']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body[: len(body) // 2]


def _answer_to_half_a_body(client: httpx.Client) -> tuple[bytes, float]:
    """POST /v1/completions over a raw socket, sending the headers and only half of
    the body its `Content-Length` announces: the response head, and seconds to it.

    Raises:
        TimeoutError: no answer within 10 s.
    """
    url = client.base_url
    with socket.create_connection((url.host, url.port), timeout=10) as connection:
        sent = time.monotonic()
        connection.sendall(_half_a_body(client))
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = connection.recv(4096)
            assert chunk, answer
            answer += chunk
        return answer.partition(b"\r\n\r\n")[0], time.monotonic() - sent


def _overload_burst(guarded: httpx.Client) -> tuple[list[float], float]:
    """One burst of 5x the capacity, checked: 200s whose streams complete and 429/503s
    with `Retry-After`, none hung, every admitted request given back. Returns the
    refusals' seconds to their response headers, and the seconds to the end of the
    first admitted stream to finish."""
    before = _wait_admission(guarded, lambda a: a["in_flight"] == 0)
    n = 5 * CAPACITY
    answers, threads, start = _burst(guarded, n, MAX_TOKENS)
    start.wait(60)
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    assert len(answers) == n
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    assert {a.status for a in refused} <= {429, 503}, [a.status for a in refused]
    assert all(a.retry_after == "2" for a in refused)
    assert ok and refused, (len(ok), len(refused))
    assert all(a.done and a.error is None and a.tokens == MAX_TOKENS for a in ok), ok
    after = _wait_admission(guarded, lambda a: a["in_flight"] == 0)  # every admitted request was given back
    assert after["capacity"] == CAPACITY
    assert after["admitted"] - before["admitted"] == len(ok)
    assert after["refused_429"] + after["refused_503"] - before["refused_429"] - before["refused_503"] == len(refused)
    assert "max_queued_per_rank" in after["last_refusal"]
    return [a.headers_s for a in refused], min(a.end_s for a in ok)


def test_overload_is_refused_at_once(guarded: httpx.Client) -> None:
    """`BURSTS` bursts of 5x the capacity at once (`_overload_burst`): 200s whose
    streams complete, and 429s with `Retry-After`; nothing hangs (each thread is joined
    with a bound), and every admitted request is given back. In each burst the median
    refusal, timed at the client, comes before the first admitted stream has finished.
    Then, with the capacity held by long streams: a refusal is decided from the
    headers, before the body is read (a request whose body never finishes still gets
    its 429; it hung before), and each of 10 sequential probes is a 429 well before
    any held stream frees a slot (under 1 s; the holders run for several seconds)."""
    assert guarded.post("/v1/completions", json=_completion(stream=False), headers=USER).status_code == 200  # warm
    refusals: list[float] = []
    for _ in range(BURSTS):
        burst_refusals, first_done_s = _overload_burst(guarded)
        assert statistics.median(burst_refusals) < first_done_s, (burst_refusals, first_done_s)
        refusals += burst_refusals
    burst = sorted(refusals)
    median, p90 = statistics.median(burst), burst[int(0.9 * (len(burst) - 1))]

    holders, long, hold = _burst(guarded, CAPACITY, HOLD_TOKENS)
    hold.wait(60)
    _wait_admission(guarded, lambda a: a["in_flight"] == CAPACITY)
    head, unfinished_s = _answer_to_half_a_body(guarded)
    assert head.startswith(b"HTTP/1.1 429") and b"\r\nretry-after: 2" in head.lower(), head
    probes = []
    for _ in range(10):
        sent = time.monotonic()
        response = guarded.post("/v1/completions", json=_completion(stream=False), headers=USER)
        probes.append(time.monotonic() - sent)
        assert response.status_code == 429 and response.headers["retry-after"] == "2", response.text
    for thread in long:
        thread.join(180)
    assert not any(thread.is_alive() for thread in long), "a held stream hung"
    assert all(a.status == 200 and a.done and a.tokens == HOLD_TOKENS for a in holders), holders
    print(
        f"\noverload: {BURSTS} bursts, {len(burst)} refused; refusals in {median * 1e3:.0f} ms median, "
        f"{p90 * 1e3:.0f} ms p90, {burst[-1] * 1e3:.0f} ms max; a refusal before its body in "
        f"{unfinished_s * 1e3:.0f} ms; sequential refusals {min(probes) * 1e3:.1f} ms min, "
        f"{statistics.median(probes) * 1e3:.1f} ms median, {max(probes) * 1e3:.1f} ms max"
    )
    assert max(probes) < 1.0, probes
    _wait_admission(guarded, lambda a: a["in_flight"] == 0)


def test_a_stalled_body_gives_its_place_back(guarded: httpx.Client) -> None:
    """An admitted request whose body stops halfway is answered 408 naming the body
    after `ingress.body_timeout_s`, and its admission place is given back (a client
    that stalled its uploads held every place for as long as it kept them open)."""
    _wait_admission(guarded, lambda a: a["in_flight"] == 0)
    head, waited_s = _answer_to_half_a_body(guarded)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert BODY_TIMEOUT_S <= waited_s < BODY_TIMEOUT_S + 5, waited_s
    _wait_admission(guarded, lambda a: a["in_flight"] == 0)
    response = guarded.post("/v1/completions", json=_completion(stream=False, max_tokens=2), headers=USER)
    assert response.status_code == 200, response.text


def _abandon_half_a_body(client: httpx.Client) -> None:
    """POST /v1/completions over a raw socket with the headers and half the body its
    `Content-Length` announces, then close the connection without waiting for an answer."""
    url = client.base_url
    with socket.create_connection((url.host, url.port), timeout=10) as connection:
        connection.sendall(_half_a_body(client))
        time.sleep(0.2)  # admitted: the ingress is reading the body


def test_an_abandoned_body_gives_its_place_back(guarded: httpx.Client) -> None:
    """A client that closes its connection halfway through an admitted request's body
    gives its admission place back. Before, only a body that timed out did:
    each abandoned upload held its place for good (`ClientDisconnect` while reading the
    body), and `CAPACITY` of them refused every later request with 429 until a restart."""
    _wait_admission(guarded, lambda a: a["in_flight"] == 0)
    for _ in range(CAPACITY):
        _abandon_half_a_body(guarded)
    _wait_admission(guarded, lambda a: a["in_flight"] == 0, within_s=BODY_TIMEOUT_S + 5)
    response = guarded.post("/v1/completions", json=_completion(stream=False, max_tokens=2), headers=USER)
    assert response.status_code == 200, response.text


def test_deadline_header(guarded: httpx.Client) -> None:
    for bad in ("soon", "-5", "0"):
        response = guarded.post("/v1/completions", json=_completion(), headers=USER | {"x-request-deadline-ms": bad})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "x-request-deadline-ms"
    long = _completion(stream=False, max_tokens=400)
    response = guarded.post("/v1/completions", json=long, headers=USER | {"x-request-deadline-ms": "1"})
    # refused as infeasible (latency samples exist) or aborted at the deadline: never served late
    assert response.status_code in (429, 504), response.text
    assert "x-request-deadline-ms" in response.json()["error"]["message"]
    response = guarded.post(
        "/v1/completions",
        json=_completion(stream=False, max_tokens=4),
        headers=USER | {"x-request-deadline-ms": "60000"},
    )
    assert response.status_code == 200, response.text
    assert guarded.get("/afd/status").json()["admission"]["in_flight"] == 0


ROUTES = [
    ("GET", "/v1/models", None, USER, 200),
    ("POST", "/v1/completions", _completion(stream=False, max_tokens=2), USER, 200),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        USER,
        200,
    ),
    ("POST", "/afd/scale", {"attention": 1, "ffn": 1}, ADMIN, 200),
    ("POST", "/afd/autoscale/resume", None, ADMIN, 200),
    ("POST", "/afd/autoscale/policy", {}, ADMIN, 200),  # an empty policy: 1:1, no signals
    ("POST", "/afd/eplb", None, ADMIN, 409),  # a dense model: no expert load to rebalance
]
"""method, route, body, the key it needs, the status once it has that key."""


@pytest.mark.parametrize(("method", "route", "body", "key", "allowed"), ROUTES, ids=[r[1] for r in ROUTES])
def test_protected_routes_need_their_key(
    guarded: httpx.Client, method: str, route: str, body: dict | None, key: dict[str, str], allowed: int
) -> None:
    other = ADMIN if key is USER else USER
    for headers in ({}, {"Authorization": "Bearer wrong"}, other, {"Authorization": API_KEY}):
        response = guarded.request(method, route, json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
    response = guarded.request(method, route, json=body, headers=key)
    assert response.status_code == allowed, response.text


def test_read_only_routes_stay_open(guarded: httpx.Client) -> None:
    assert guarded.get("/afd/status").status_code == 200
    assert guarded.get("/health").status_code == 200


def test_missing_key_variable_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ingress.admin_key_env: the environment variable 'AFD_UNSET_KEY_VAR'"):
        build_app({"ingress": {"admin_key_env": "AFD_UNSET_KEY_VAR"}})


def test_chat_with_content_parts(guarded: httpx.Client) -> None:
    """Content as a list of parts (OpenAI's format) reaches the engine; the fuzz test
    found it was a 500 (vLLM's `Iterable` fields could not be pickled to the replica)."""
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    response = guarded.post("/v1/chat/completions", json=body, headers=USER)
    assert response.status_code == 200, response.text
    bad = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    response = guarded.post("/v1/chat/completions", json=bad, headers=USER)
    assert response.status_code == 400, response.text
