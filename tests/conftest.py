"""Fixtures shared by the whole suite."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from afd_ray.serve.app import build_app

YAML = Path(__file__).parents[1] / "deployments" / "afd.yaml"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A fresh single-node Ray cluster, shut down after the session.

    Ray binds its own services to the node's IP (it rewrites a loopback
    `_node_ip_address` to that IP); the Serve HTTP proxies the tests start listen
    on 127.0.0.1 only.

    `RAY_AUTH_MODE=disabled`: Ray 2.60 turns on token auth for every new local
    cluster, writing a token to `~/.ray/auth_token` that each driver and `serve`
    call must then carry. A throwaway cluster that lives for one test session has
    nothing to protect, and the variable has to be set before `ray.init`, which
    reads it.

    `num_cpus=8` logical CPUs on a 2-core machine: Ray CPUs are scheduling units,
    and the pools' bundles (one CPU each) plus the Serve controller and proxy need
    more units than there are cores. The cores are shared by the OS scheduler.
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, num_cpus=8)
        yield
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def args() -> dict[str, object]:
    """The `args` of the `afd` application in the shipped `deployments/afd.yaml`."""
    (application,) = yaml.safe_load(YAML.read_text())["applications"]
    return application["args"]


@pytest.fixture(scope="session")
def serve_url(ray_cluster: None) -> Iterator[str]:
    """Ray Serve on the session cluster, its HTTP proxy on a free loopback port."""
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def client(serve_url: str, args: dict[str, object]) -> Iterator[httpx.Client]:
    """An HTTP client of the shipped application, deployed once per session at `/`
    (its vLLM engine and FFN rank are reused by every test)."""
    serve.run(build_app(args), name="afd", route_prefix="/")
    with httpx.Client(base_url=serve_url, timeout=120) as http:
        yield http
