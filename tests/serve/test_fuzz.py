"""Fuzzing the ingress with schemathesis: requests generated from its own OpenAPI
schema (every route, vLLM's request models included) against the guarded tiny
application of tests/serve/test_admission.py. No answer may be a 5xx and no replica
may crash. Bounded: `EXAMPLES` cases per operation and every inference request carries
`x-request-deadline-ms`, so a fuzzed `max_tokens` cannot run long.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import schemathesis
from guarded_app import ADMIN, NAME, USER
from hypothesis import HealthCheck, Phase, given, settings

from afd_ray.control.serve_api import replica_states

EXAMPLES = 12
"""Generated cases per operation (about 1 minute in all on a 2-core machine)."""
DEADLINE_MS = "3000"


DEPLOYMENTS = ("ingress", "coordinator", "attention", "ffn")


def _replicas() -> dict[str, dict[str, str]]:
    """Serve's state of every replica of each deployment, by replica id."""

    async def read() -> dict[str, dict[str, str]]:
        return {name: await replica_states(NAME, name) for name in DEPLOYMENTS}

    return asyncio.run(read())


def test_fuzzed_requests_get_no_5xx(guarded: httpx.Client) -> None:
    base = str(guarded.base_url).rstrip("/")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    replicas = _replicas()
    failures: list[str] = []
    started = time.monotonic()
    cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        headers = (ADMIN if operation.path.startswith("/afd/") else USER) | {"x-request-deadline-ms": DEADLINE_MS}

        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy())
        def run(case: schemathesis.Case) -> None:
            nonlocal cases
            cases += 1
            # schemathesis serializes the case; httpx sends it (its own `case.call` uses
            # `requests`, which the `urllib3-future` in this environment breaks).
            sent = case.as_transport_kwargs(base_url=base, headers=headers)
            body = sent.get("data")
            try:
                response = guarded.request(
                    sent["method"], sent["url"], headers=sent["headers"], params=sent.get("params"),
                    cookies=sent.get("cookies") or None, json=sent.get("json"), timeout=30,
                    content=body if isinstance(body, (bytes, str)) else None,
                    data=body if isinstance(body, dict) else None,
                )
            except (httpx.LocalProtocolError, UnicodeEncodeError):  # not sendable as HTTP: nothing to test
                return
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}")

        run()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {cases} cases over {len(list(schema.get_all_operations()))} operations in {elapsed:.0f} s")
    assert not failures, "\n".join(failures)
    assert _replicas() == replicas  # the same replicas, all RUNNING: none crashed or was replaced
    assert all(state == "RUNNING" for states in replicas.values() for state in states.values())
    response = guarded.post("/v1/completions", headers=USER,
                            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert response.status_code == 200, response.text
