"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


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
