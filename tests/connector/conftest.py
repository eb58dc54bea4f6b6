"""Fixtures of the connector tests: the CPU transports, and opening a pair."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import HeaderKind, StepHeader


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test that takes it runs over each CPU transport of the connector contract."""
    return request.param


def _open_pair(
    ffn: FFNChannel, peer: int, transport: str, epoch: int = 0, timeout_s: float = 10, ubatch_groups: int = 1
) -> AttentionChannel:
    """The attention side of a pair with `ffn`, opened in this thread while another
    thread reads its JOIN and admits it (both block until paired)."""
    joins: list[StepHeader | None] = []

    def admit() -> None:
        joins.append(header := ffn.recv_header(10))
        if header is not None and header.kind is HeaderKind.JOIN:
            ffn.admit(header.peer)

    admitter = threading.Thread(target=admit)
    admitter.start()
    attention = AttentionChannel(ffn.address, peer, epoch, transport, timeout_s=timeout_s, ubatch_groups=ubatch_groups)
    admitter.join(10)
    assert not admitter.is_alive() and joins and joins[0] is not None and joins[0].kind is HeaderKind.JOIN, joins
    return attention


@pytest.fixture
def open_pair() -> Callable[..., AttentionChannel]:
    """`open_pair(ffn, peer, transport, epoch=0, timeout_s=10, ubatch_groups=1)`: the
    attention side of a pair with the FFN channel `ffn`, admitted there."""
    return _open_pair
