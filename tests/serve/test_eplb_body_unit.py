"""`POST /afd/eplb`'s optional body without Ray: `rebalance_request` behind the
ingress's own error handlers (`add_handlers`), so a bad body is the 400 a client gets,
naming the field. The rebalance it asks for is served in tests/e2e/test_eplb.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from afd_ray.config.eplb import EPLBConfig
from afd_ray.serve.admin import rebalance_request
from afd_ray.serve.errors import add_handlers

CONFIGURED = 2
"""`ffn.eplb.num_redundant_experts` of the app."""


@pytest.fixture(scope="module")
def route() -> TestClient:
    """A client of an app whose `POST /afd/eplb` answers the count its body asks for."""
    app = FastAPI()
    add_handlers(app)
    eplb = EPLBConfig(num_redundant_experts=CONFIGURED)

    @app.post("/afd/eplb")
    async def asked(request: Request) -> dict:
        return {"num_redundant_experts": rebalance_request(await request.body(), eplb)}

    return TestClient(app)


@pytest.mark.parametrize(
    ("body", "asked"),
    [(b"", None), (b" \n", None), (b"{}", None), (b'{"num_redundant_experts": null}', None)]
    + [(f'{{"num_redundant_experts": {r}}}'.encode(), r) for r in range(CONFIGURED + 1)],
)
def test_a_count_up_to_the_configured_one_is_asked(route: TestClient, body: bytes, asked: int | None) -> None:
    response = route.post("/afd/eplb", content=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"num_redundant_experts": asked}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (b'{"num_redundant_experts": 3}', "num_redundant_experts", "outside [0, 2]"),
        (b'{"num_redundant_experts": -1}', "num_redundant_experts", "greater than or equal to 0"),
        (b'{"num_redundant_experts": "1"}', "num_redundant_experts", "valid integer"),
        (b'{"num_redundant_experts": 1.0}', "num_redundant_experts", "valid integer"),
        (b'{"num_redundant_experts": true}', "num_redundant_experts", "valid integer"),
        (b'{"redundant": 1}', "redundant", "Extra inputs"),
        (b"[1]", "body", "should be an object"),
        (b"{", "body", "Invalid JSON"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(route: TestClient, body: bytes, param: str, says: str) -> None:
    response = route.post("/afd/eplb", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
