"""Fuzzing the ingress with schemathesis: requests generated from its own OpenAPI
schema (every route, vLLM's request models included) against the guarded tiny
application of tests/serve/conftest.py (the same deployment the admission and access
tests use). No answer may be an unintended 5xx, in the status line or in an SSE error
event, and no replica may crash.

The ingress's own intended answers are not failures: a 504 `DeadlineExceededError`
naming `x-request-deadline-ms` (the fuzzed request outran its deadline) and a 429/503
refusal with `Retry-After` (admission). Anything else >= 500 is.

Bounded: at most `EXAMPLES` cases per operation, and none starts after the operation's
`OPERATION_BUDGET_S`; every inference request carries a `DEADLINE_MS` deadline (a
fuzzed `max_tokens` cannot run long).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import schemathesis
from guarded_app import ADMIN, NAME, USER
from hypothesis import HealthCheck, Phase, given, settings

from afd_ray.control.serve_api import replica_states

EXAMPLES = 10
"""Generated cases per operation."""
DEADLINE_MS = "2000"
OPERATION_BUDGET_S = 12.0
"""No case of an operation starts after this many seconds of it; the number run is printed."""
DEPLOYMENTS = ("ingress", "coordinator", "attention", "ffn")


def _replicas() -> dict[str, dict[str, str]]:
    """Serve's state of every replica of each deployment, by replica id."""

    async def read() -> dict[str, dict[str, str]]:
        return {name: await replica_states(NAME, name) for name in DEPLOYMENTS}

    return asyncio.run(read())


def _unintended(status: int, headers: httpx.Headers, error: dict | None) -> bool:
    """A 5xx that is not one of the ingress's intended answers (`error`: the OpenAI
    error body, if any)."""
    if status < 500:
        return False
    if status == 504 and error is not None:
        return not (error.get("type") == "DeadlineExceededError" and error.get("param") == "x-request-deadline-ms")
    if status == 503 and headers.get("retry-after"):
        return False  # an admission refusal
    return True


def _problems(response: httpx.Response) -> list[str]:
    """The unintended 5xx answers in `response`: its status, or an SSE error event."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    found = []
    if _unintended(response.status_code, response.headers, error if isinstance(error, dict) else None):
        found.append(f"{response.status_code} {response.text[:300]}")
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            error = event.get("error")
            if isinstance(error, dict) and _unintended(int(error.get("code") or 0), httpx.Headers(), error):
                found.append(f"SSE error event {line[:300]}")
    return found


def test_intended_answer_rules() -> None:
    """The rules above, on answers the ingress gives and ones it must not."""
    deadline = {"type": "DeadlineExceededError", "param": "x-request-deadline-ms", "code": 504}
    assert not _unintended(504, httpx.Headers(), deadline)
    assert not _unintended(503, httpx.Headers({"retry-after": "2"}), {"type": "ServiceUnavailableError"})
    assert not _unintended(429, httpx.Headers(), None)
    assert _unintended(504, httpx.Headers(), {"type": "GatewayTimeout", "param": None})
    assert _unintended(503, httpx.Headers(), {"type": "ServiceUnavailableError"})
    assert _unintended(500, httpx.Headers(), {"type": "InternalServerError"})
    stream = httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        text='data: {"error": {"code": 500, "type": "X"}}\n\ndata: [DONE]\n\n',
    )
    assert _problems(stream)


def test_fuzzed_requests_get_no_5xx(guarded: httpx.Client) -> None:
    base = str(guarded.base_url).rstrip("/")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    replicas = _replicas()
    assert all(state == "RUNNING" for states in replicas.values() for state in states.values()), replicas
    failures: list[str] = []
    started = time.monotonic()
    cases = operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        begun = time.monotonic()
        headers = (ADMIN if operation.path.startswith("/afd/") else USER) | {"x-request-deadline-ms": DEADLINE_MS}

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: schemathesis.Case) -> None:
            nonlocal cases
            if time.monotonic() - begun > OPERATION_BUDGET_S:
                return
            cases += 1
            # schemathesis serializes the case; httpx sends it (its own `case.call` uses
            # `requests`, which the `urllib3-future` in this environment breaks).
            sent = case.as_transport_kwargs(base_url=base, headers=headers)
            body = sent.get("data")
            try:
                response = guarded.request(
                    sent["method"],
                    sent["url"],
                    headers=sent["headers"],
                    params=sent.get("params"),
                    cookies=sent.get("cookies") or None,
                    json=sent.get("json"),
                    timeout=30,
                    content=body if isinstance(body, (bytes, str)) else None,
                    data=body if isinstance(body, dict) else None,
                )
            except (httpx.LocalProtocolError, UnicodeEncodeError):  # not sendable as HTTP: nothing to test
                return
            failures.extend(f"{case.method} {case.path} {case.body!r}: {p}" for p in _problems(response))

        run()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {cases} cases over {operations} operations in {elapsed:.0f} s")
    assert not failures, "\n".join(failures)
    assert _replicas() == replicas  # the same replicas, all RUNNING: none crashed or was replaced
    response = guarded.post(
        "/v1/completions", headers=USER, json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200, response.text
