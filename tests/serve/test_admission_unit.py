"""Admission bounds and access keys without Ray: each bound refuses with the status and
a message naming its config field; the in-flight count is exact; keys come only from
the environment variables the config names."""

from __future__ import annotations

from http import HTTPStatus

import pydantic
import pytest
from starlette.requests import Request

from afd_ray.config import AFDConfig, IngressConfig
from afd_ray.control.membership import PoolLoad
from afd_ray.serve.access import AccessKeys, Role
from afd_ray.serve.admission import Admission


def _admission(**bounds: object) -> Admission:
    return Admission(IngressConfig(max_queued_per_rank=1, **bounds), max_num_seqs=2)


def _admit(admission: Admission, deadline_s: float | None = None, max_tokens: int | None = None) -> object:
    """Both steps, as the ingress takes them: `reserve` (headers), then `admit` (body)."""
    refusal = admission.reserve()
    if refusal is not None:
        return refusal
    refusal = admission.admit(deadline_s, max_tokens)
    if refusal is not None:
        admission.release()
    return refusal


def test_queue_room_is_counted_exactly() -> None:
    admission = _admission()
    assert admission.reserve().status == HTTPStatus.SERVICE_UNAVAILABLE  # no load read yet: no rank
    admission.update(PoolLoad(attention_ranks=2))
    assert admission.capacity == 6
    assert [_admit(admission) for _ in range(5)] == [None] * 5
    assert admission.reserve() is None  # the 6th place, its body not read yet: it counts
    refusal = admission.reserve()
    assert refusal.status == HTTPStatus.TOO_MANY_REQUESTS and "max_queued_per_rank" in refusal.message
    admission.release()  # the 6th body did not validate (400): neither admitted nor refused
    assert _admit(admission) is None
    admission.update(PoolLoad(attention_ranks=2, resizing=True))
    assert admission.reserve().status == HTTPStatus.SERVICE_UNAVAILABLE  # full while resizing: 503
    state = admission.state()
    assert (state.in_flight, state.admitted, state.refused_429, state.refused_503) == (6, 6, 1, 2)


def test_kv_and_ffn_bounds() -> None:
    admission = _admission(max_kv_cache_usage=0.5, max_ffn_tokens_per_step=8)
    admission.update(PoolLoad(attention_ranks=1, kv_cache_usage=0.5))
    assert "ingress.max_kv_cache_usage" in admission.reserve().message
    admission.update(PoolLoad(attention_ranks=1, kv_cache_usage=0.4, ffn_tokens_per_step=8))
    assert "ingress.max_ffn_tokens_per_step" in admission.reserve().message
    admission.update(PoolLoad(attention_ranks=1, kv_cache_usage=0.4, ffn_tokens_per_step=7.5))
    assert _admit(admission) is None


def test_deadline_feasibility() -> None:
    admission = _admission()
    admission.update(PoolLoad(attention_ranks=1))
    assert _admit(admission, deadline_s=0.001, max_tokens=100) is None  # no latency samples yet
    admission.update(PoolLoad(attention_ranks=1, ttft_p90_s=0.2, tpot_p90_s=0.01))
    assert _admit(admission, deadline_s=1.3, max_tokens=100) is None  # 0.2 + 100 x 0.01 = 1.2 s
    refusal = _admit(admission, deadline_s=1.1, max_tokens=100)
    assert refusal.status == HTTPStatus.TOO_MANY_REQUESTS and "x-request-deadline-ms" in refusal.message
    state = admission.state()  # the refused request's place was given back
    assert (state.in_flight, state.admitted, state.refused_429) == (2, 2, 1)


def test_capacity_must_fit_the_ingress() -> None:
    with pytest.raises(pydantic.ValidationError, match="ingress.max_ongoing_requests: 64 must exceed"):
        AFDConfig(attention={"max_ranks": 2, "max_num_seqs": 16}, ingress={"max_ongoing_requests": 64})


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def test_keys_come_from_the_named_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AccessKeys.from_env(IngressConfig()).denied(_request(None), Role.ADMIN) is None  # open by default
    with pytest.raises(ValueError, match="ingress.api_key_env: the environment variable 'AFD_TEST_KEY'"):
        AccessKeys.from_env(IngressConfig(api_key_env="AFD_TEST_KEY"))
    monkeypatch.setenv("AFD_TEST_KEY", "user-secret")
    monkeypatch.setenv("AFD_TEST_ADMIN", "admin-secret")
    keys = AccessKeys.from_env(IngressConfig(api_key_env="AFD_TEST_KEY", admin_key_env="AFD_TEST_ADMIN"))
    assert "secret" not in repr(keys)
    assert "needs the api key" in keys.denied(_request(None), Role.USER)
    assert keys.denied(_request("Bearer admin-secret"), Role.USER) == "wrong api key"
    assert keys.denied(_request("Basic user-secret"), Role.USER) is not None
    assert keys.denied(_request("Bearer user-secret"), Role.USER) is None
    assert keys.denied(_request("Bearer user-secret"), Role.ADMIN) == "wrong admin key"
    assert keys.denied(_request("bearer admin-secret"), Role.ADMIN) is None
