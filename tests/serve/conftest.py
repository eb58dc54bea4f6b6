"""The guarded tiny application shared by the admission, access and fuzz tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from guarded_app import (
    ADMIN_KEY,
    API_KEY,
    BODY_TIMEOUT_S,
    ENGINE_ARGS,
    KV_CACHE_GIB,
    MAX_NUM_SEQS,
    NAME,
    PREFIX,
    QUEUED,
)
from ray import serve

from afd_ray.models.tiny import build_tiny
from afd_ray.serve.app import build_app


@pytest.fixture(scope="session")
def guarded(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A tiny Llama (float32, 1A:1F) with a small admission capacity and keys read from
    `AFD_TEST_API_KEY` / `AFD_TEST_ADMIN_KEY`, and vLLM engine arguments of its own
    (`ENGINE_ARGS`); a client at its route prefix."""
    checkpoint = build_tiny("llama", tmp_path_factory.mktemp("guarded") / "llama")
    args = {
        "model": {"source": str(checkpoint), "served_name": "tiny", "max_model_len": 512},
        "ingress": {
            "max_ongoing_requests": 64,
            "max_queued_per_rank": QUEUED,
            "retry_after_s": 2,
            "body_timeout_s": BODY_TIMEOUT_S,
            "api_key_env": "AFD_TEST_API_KEY",
            "admin_key_env": "AFD_TEST_ADMIN_KEY",
        },
        "attention": {
            "num_ranks": 1,
            "kv_cache_gib": KV_CACHE_GIB,
            "max_num_seqs": MAX_NUM_SEQS,
            "bundle_resources": 0.5,
            "engine_args": ENGINE_ARGS,
        },
        "ffn": {"num_ranks": 1, "bundle_resources": 0.5},
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AFD_TEST_API_KEY", API_KEY)
        env.setenv("AFD_TEST_ADMIN_KEY", ADMIN_KEY)
        app = build_app(args)
    serve.run(app, name=NAME, route_prefix=PREFIX, external_scaler_enabled=True)
    try:
        with httpx.Client(base_url=serve_url + PREFIX, timeout=120) as client:
            yield client
    finally:
        serve.delete(NAME)
