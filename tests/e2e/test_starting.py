"""An application that is still starting, over real HTTP on the session Ray cluster.

Its FFN pool claims a Ray resource no node has, so the FFN replica is never placed
and the attention replica waits for the FFN layout, before it starts any engine: the
application stays "starting" for as long as the test needs, at the cost of its
ingress, its coordinator and one idle attention replica process (no model loads).

- Every route answers within a bound. `/health` and `/v1/models` waited for a
  running attention replica without bound (no answer within 20 s for a fresh user);
  now they answer 503 at once with a reason and `Retry-After`, like completions.
- The attention replica waits for the FFN layout up to `autoscale.resize_timeout_s`,
  not `connector.timeout_s`: under load a starting FFN rank outlasted the connector
  timeout, the attention replica's constructor failed and Serve restarted it.
- Every route that calls the coordinator answers within a bound while the coordinator
  hangs (its process stopped). `POST /afd/scale` and `POST /afd/autoscale/policy`
  waited for it without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from afd_ray.control.serve_api import replica_states
from afd_ray.serve.app import build_app
from afd_ray.serve.ingress import _CALL_S

NAME = "starting"
PREFIX = f"/{NAME}"
CONNECTOR_TIMEOUT_S = 1.0
"""`connector.timeout_s` of the app: the old bound on the attention replica's wait."""
RESIZE_TIMEOUT_S = 12.0
"""`autoscale.resize_timeout_s` of the app: the bound on that wait. Also the graceful
shutdown time Serve gives the never-placed FFN replica when the app is deleted."""
ANSWER_WITHIN_S = 3.0
"""Bound on each answer of the starting app (none waits for a pool member)."""
UP_WITHIN_S = 240.0
"""Bound on the ingress answering and the attention replica reaching its wait (a
process start that imports vLLM, on a loaded 2-core machine)."""


@pytest.fixture(scope="module")
def starting(serve_url: str, args: dict[str, object]) -> Iterator[httpx.Client]:
    """The shipped YAML's app with an unplaceable FFN pool, deployed without waiting
    for it to run; a client at its route prefix once its ingress answers."""
    overrides = {
        "ffn": args["ffn"] | {"placement": {"resources": {"afd_test_absent_resource": 1}}},
        "connector": args["connector"] | {"timeout_s": CONNECTOR_TIMEOUT_S},
        "autoscale": args["autoscale"] | {"resize_timeout_s": RESIZE_TIMEOUT_S},
    }
    target = serve.RunTarget(build_app(args | overrides), name=NAME, route_prefix=PREFIX)
    serve.run_many([target], wait_for_applications_running=False)
    try:
        with httpx.Client(base_url=serve_url + PREFIX, timeout=60) as client:
            deadline = time.monotonic() + UP_WITHIN_S
            while client.get("/afd/status").status_code != 200:
                assert time.monotonic() < deadline, "the starting app's ingress never answered"
                time.sleep(0.2)
            yield client
    finally:
        serve.delete(NAME)


def _waiting(client: httpx.Client) -> dict[str, float]:
    return client.get("/afd/status").json()["attention_waiting"]


def _attention_waits(client: httpx.Client) -> tuple[str, float]:
    """The attention replica waiting for the FFN layout, and seconds it has waited."""
    deadline = time.monotonic() + UP_WITHIN_S
    while not (waiting := _waiting(client)):
        assert time.monotonic() < deadline, "the attention replica never reached its wait for the FFN layout"
        time.sleep(0.2)
    ((replica, waited_s),) = waiting.items()
    return replica, waited_s


def test_attention_waits_for_the_ffn_layout_past_the_connector_timeout(starting: httpx.Client) -> None:
    """The same attention replica still waits (and Serve still starts it, no
    constructor failed) 2 s past `connector.timeout_s`, well within
    `autoscale.resize_timeout_s`. With the old bound its wait ended after 1 s."""
    replica, waited_s = _attention_waits(starting)
    time.sleep(max(CONNECTOR_TIMEOUT_S + 2 - waited_s, 0))

    waiting = _waiting(starting)
    assert list(waiting) == [replica], waiting
    assert CONNECTOR_TIMEOUT_S + 2 <= waiting[replica] < RESIZE_TIMEOUT_S, waiting
    states = asyncio.run(replica_states(NAME, "attention"))
    assert states == {replica: "STARTING"}, states


ROUTES = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}),
]


@pytest.mark.parametrize(("method", "route", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_answers_at_once_while_starting(
    starting: httpx.Client, method: str, route: str, body: dict | None
) -> None:
    _attention_waits(starting)
    sent = time.monotonic()
    response = starting.request(method, route, json=body)
    took_s = time.monotonic() - sent

    assert response.status_code == 503, response.text
    assert took_s < ANSWER_WITHIN_S, took_s
    assert response.headers["retry-after"] == "1"  # ingress.retry_after_s of the YAML
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "no attention rank is ready: the application is starting" in error["message"]


def test_status_shows_the_attention_replica_waiting(starting: httpx.Client) -> None:
    replica, _ = _attention_waits(starting)
    status = starting.get("/afd/status").json()
    assert status["attention"] == [] and status["ffn"] == []  # no rank registered yet
    assert list(status["attention_waiting"]) == [replica]


COORDINATOR_ROUTES = [
    ("POST", "/afd/scale", {"json": {"attention": 1, "ffn": 1}}),
    ("POST", "/afd/autoscale/policy", {"content": "{}"}),  # the default policy: 1A:1F, no signals
    ("POST", "/afd/autoscale/resume", {}),
    ("GET", "/afd/status", {}),
    ("GET", "/afd/trace/some-request", {}),
]
"""The routes that call the coordinator, each with a body it accepts."""
SLACK_S = 8.0
"""Allowance over each bound for the loaded 2-core machine, seconds."""


def _coordinator_pid() -> int:
    """The process id of the starting app's coordinator replica, from Serve's controller."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_deployment_details.remote(NAME, "coordinator"))
    (pid,) = [r.pid for r in details.replicas if r.state.value == "RUNNING"]
    return pid


def _all_at_once(client: httpx.Client, timeout_s: float) -> dict[str, tuple[int | None, str | None, float, str]]:
    """Each of `COORDINATOR_ROUTES` at once, by route: status (None: no answer within
    `timeout_s`), `Retry-After`, seconds to the answer, error message."""
    answers: dict[str, tuple[int | None, str | None, float, str]] = {}

    def call(method: str, route: str, body: dict[str, object]) -> None:
        sent = time.monotonic()
        try:
            response = client.request(method, route, timeout=timeout_s, **body)
        except httpx.TimeoutException:
            answers[route] = (None, None, time.monotonic() - sent, "no answer")
            return
        message = response.json()["error"]["message"] if response.status_code >= 400 else ""
        answers[route] = (response.status_code, response.headers.get("retry-after"), time.monotonic() - sent, message)

    threads = [threading.Thread(target=call, args=route) for route in COORDINATOR_ROUTES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return answers


def test_coordinator_routes_answer_while_the_coordinator_hangs(starting: httpx.Client) -> None:
    """The coordinator's process stopped (SIGSTOP: alive, answering nothing, like a
    hung event loop). Each route that calls it answers 503 with `Retry-After` within
    its bound: `_CALL_S`, and `autoscale.resize_timeout_s` + `_CALL_S` for `POST
    /afd/scale` (a resize may take that long). Once the coordinator has answered none
    of the ingress's load reads for `_CALL_S`, each answers 503 at once. Last in the
    module: the coordinator is resumed and answers again before the app is deleted."""
    _attention_waits(starting)
    pid = _coordinator_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        hung = _all_at_once(starting, RESIZE_TIMEOUT_S + _CALL_S + SLACK_S)
        assert time.monotonic() - stopped >= _CALL_S
        down = _all_at_once(starting, ANSWER_WITHIN_S + SLACK_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # Serve may have replaced it
            os.kill(pid, signal.SIGCONT)
    print(
        f"\ncoordinator stopped: answers in {', '.join(f'{r} {a[2]:.1f} s' for r, a in hung.items())}; "
        f"then in {max(a[2] for a in down.values()):.2f} s at most"
    )
    for route, (status, retry_after, took_s, message) in hung.items():
        bound_s = RESIZE_TIMEOUT_S + _CALL_S if route == "/afd/scale" else _CALL_S
        assert status == 503 and retry_after == "1", (route, status, message)
        assert "the coordinator" in message, (route, message)
        assert took_s < bound_s + SLACK_S, (route, took_s)
    for route, (status, retry_after, took_s, message) in down.items():
        assert status == 503 and retry_after == "1", (route, status, message)
        assert "the coordinator has answered nothing for" in message, (route, message)
        assert took_s < ANSWER_WITHIN_S, (route, took_s)
    deadline = time.monotonic() + UP_WITHIN_S
    while starting.get("/afd/status").status_code != 200:
        assert time.monotonic() < deadline, "the resumed coordinator never answered again"
        time.sleep(0.2)
