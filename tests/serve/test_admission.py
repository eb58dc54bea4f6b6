"""Deadlines and access keys through the real application: a tiny Llama
(float32, 1A:1F) with a small admission capacity, an API key and an admin key, over
real HTTP on the session Ray cluster (the `guarded` fixture of tests/serve/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from guarded_app import ADMIN, API_KEY, MAX_TOKENS, USER

from afd_ray.serve.app import build_app


def _completion(stream: bool = True, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


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
    response = guarded.post("/v1/completions", json=_completion(stream=False, max_tokens=4),
                            headers=USER | {"x-request-deadline-ms": "60000"})  # fmt: skip
    assert response.status_code == 200, response.text
    assert guarded.get("/afd/status").json()["admission"]["in_flight"] == 0


ROUTES = [
    ("GET", "/v1/models", None, USER),
    ("POST", "/v1/completions", _completion(stream=False, max_tokens=2), USER),
    ("POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, USER),
    ("POST", "/afd/scale", {"attention": 1, "ffn": 1}, ADMIN),
    ("POST", "/afd/autoscale/resume", None, ADMIN),
]  # fmt: skip


@pytest.mark.parametrize(("method", "route", "body", "key"), ROUTES, ids=[r[1] for r in ROUTES])
def test_protected_routes_need_their_key(
    guarded: httpx.Client, method: str, route: str, body: dict | None, key: dict[str, str]
) -> None:
    other = ADMIN if key is USER else USER
    for headers in ({}, {"Authorization": "Bearer wrong"}, other, {"Authorization": API_KEY}):
        response = guarded.request(method, route, json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
    response = guarded.request(method, route, json=body, headers=key)
    assert response.status_code == 200, response.text


def test_read_only_routes_stay_open(guarded: httpx.Client) -> None:
    assert guarded.get("/afd/status").status_code == 200
    assert guarded.get("/health").status_code == 200


def test_missing_key_variable_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ingress.admin_key_env: the environment variable 'AFD_UNSET_KEY_VAR'"):
        build_app({"ingress": {"admin_key_env": "AFD_UNSET_KEY_VAR"}})


def test_chat_with_content_parts(guarded: httpx.Client) -> None:
    """Content as a list of parts (OpenAI's format) reaches the engine; the fuzz test
    found it was a 500 (vLLM's `Iterable` fields could not be pickled to the replica)."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    response = guarded.post("/v1/chat/completions", json=body, headers=USER)
    assert response.status_code == 200, response.text
    bad = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    response = guarded.post("/v1/chat/completions", json=bad, headers=USER)
    assert response.status_code == 400, response.text
