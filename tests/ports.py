"""Free loopback ports for what the tests start themselves (Serve's HTTP ingress, the
Ray dashboard, Prometheus); importable by the driver scripts the tests run in their
own processes (their `PYTHONPATH` names this folder)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
