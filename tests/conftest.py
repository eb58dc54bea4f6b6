"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray._private import ray_constants

from afd_ray.compat import any_dashboard_agent_port
from afd_ray.serve.app import build_app
from afd_ray.serve.ingress_env import private_cluster_env
from ports import free_port

YAML = Path(__file__).parents[1] / "deployments" / "afd.yaml"

FIRST, LAST = "client", "guarded"
"""Session fixtures that each keep a Serve application (its vLLM engine, FFN rank,
ingress and coordinator) alive from their first user to the end of the session.
Every idle application costs CPU (Ray and Serve's own loops: about a third of a core
measured on the 2-core CI machine) and memory, and slows every later engine start,
so the modules using `FIRST` run first, those using `LAST` run last, and `FIRST`'s
application is deleted right after its last user."""
SESSION_APP = "afd"
"""The Serve application name of `client`."""
_LAST_USER = pytest.StashKey[pytest.Item]()


DEFAULT_TIMEOUT_S = 600
"""pytest-timeout's limit of every test that sets none (`pytest.mark.timeout`), its
fixtures' setup included (the first user of a session application deploys it): a hang
fails with its stack instead of running into CI's limit."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test without a `timeout` mark `DEFAULT_TIMEOUT_S` (an explicit
    `--timeout` or a `timeout` ini setting replaces this default), then order whole
    modules (tests inside a module keep their order): those that use `FIRST`, then
    the others, then those that use `LAST`; stable otherwise."""
    if config.getoption("timeout", None) is None and not config.getini("timeout"):
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))
    uses: dict[object, set[str]] = {}
    for item in items:
        uses.setdefault(item.module, set()).update(item.fixturenames)
    items.sort(key=lambda item: 0 if FIRST in uses[item.module] else 2 if LAST in uses[item.module] else 1)
    users = [item for item in items if FIRST in item.fixturenames]
    if users:
        config.stash[_LAST_USER] = users[-1]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Delete `FIRST`'s application once its last user is done (the session's Serve
    instance stays for the others), without waiting for its replicas to stop (its
    ingress alone stays 5 s, `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`)."""
    if item is item.config.stash.get(_LAST_USER, None) and nextitem is not None:
        serve.delete(SESSION_APP, _blocking=False)


_DASHBOARD = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fresh single-node Ray cluster, shut down after the session.

    Ray binds its own services to the node's IP (it rewrites a loopback
    `_node_ip_address` to that IP); the Serve HTTP ingress the tests start (HAProxy
    and the ingress replicas' servers) listens on 127.0.0.1 only, HAProxy's stats
    page and exporter on every interface (docs/ingress.md).

    `RAY_AUTH_MODE=disabled`: Ray 2.60 turns on token auth for every new local
    cluster, writing a token to `~/.ray/auth_token` that each driver and `serve`
    call must then carry. A throwaway cluster that lives for one test session has
    nothing to protect, and the variable has to be set before `ray.init`, which
    reads it.

    Serve's ingress is HAProxy in front of the ingress replicas' own HTTP servers, as
    `make serve` runs it (`private_cluster_env`), with its extra listeners on free ports.

    `num_cpus=8` logical CPUs on a 2-core machine: Ray CPUs are scheduling units,
    and the pools' bundles (one CPU each) plus the Serve controller and proxy need
    more units than there are cores. The cores are shared by the OS scheduler.

    The dashboard (the Jobs API) runs only when a collected test uses `ray_dashboard`:
    it starts a few more processes and, on the busy 2-core machine, took up to 100 s.
    Then it listens on a free loopback port, and this interpreter's bin folder comes
    first on PATH, as `make serve` does: a job's `python ...` entrypoint runs the
    project's Python.
    """
    dashboard = any("ray_dashboard" in item.fixturenames for item in request.session.items)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        for name, value in private_cluster_env().items():
            env.setenv(name, value)
        if not dashboard:
            ray.init(address="local", include_dashboard=False, num_cpus=8)
        else:
            port = free_port()
            request.config.stash[_DASHBOARD] = f"http://127.0.0.1:{port}"
            env.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
            # Ray waits 60 s for the dashboard (RAY_DASHBOARD_STARTUP_TIMEOUT_S, read once at
            # import); on the busy 2-core machine it took 100 s and `ray.init` failed.
            env.setattr(ray_constants, "RAY_DASHBOARD_STARTUP_TIMEOUT_S", 600)
            with any_dashboard_agent_port():
                ray.init(
                    address="local",
                    include_dashboard=True,
                    dashboard_host="127.0.0.1",
                    dashboard_port=port,
                    num_cpus=8,
                )
        yield
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_dashboard(ray_cluster: None, request: pytest.FixtureRequest) -> str:
    """`http://127.0.0.1:<port>` of the session cluster's dashboard (its Jobs API)."""
    return request.config.stash[_DASHBOARD]


@pytest.fixture(scope="session")
def args() -> dict[str, object]:
    """The `args` of the `afd` application in the shipped `deployments/afd.yaml`."""
    (application,) = yaml.safe_load(YAML.read_text())["applications"]
    return application["args"]


@pytest.fixture(scope="session")
def serve_url(ray_cluster: None) -> Iterator[str]:
    """Ray Serve on the session cluster, its HTTP ingress (HAProxy) on a free loopback port."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def client(serve_url: str, args: dict[str, object]) -> Iterator[httpx.Client]:
    """An HTTP client of the shipped application, deployed once per session at `/`
    (its vLLM engine and FFN rank are reused by every test)."""
    serve.run(build_app(args), name=SESSION_APP, route_prefix="/")
    with httpx.Client(base_url=serve_url, timeout=120) as http:
        yield http
