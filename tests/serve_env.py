"""Ray's environment for the Serve clusters the tests start (the session cluster of
tests/conftest.py, test_two_nodes.py's driver)."""

from __future__ import annotations

import socket


def serve_ingress_env() -> dict[str, str]:
    """Ray's environment variables (read by the Serve controller, proxies and replicas
    when they start; Ray 2.60 has no argument for them) that make a new cluster serve
    HTTP as the Makefile's: HAProxy on the HTTP port, forwarding straight to the
    ingress replicas' own HTTP servers (direct ingress), and a 5 s drain of a stopping
    ingress replica (README "Overload, access and failures"). HAProxy's stats page,
    Prometheus exporter and the fallback Serve proxy get free ports here instead of
    Ray's fixed 8404, 9101 and 8500, so that two clusters on one machine (a test
    session and `make serve`, or `test_two_nodes`'s) do not collide."""
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_port()),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
