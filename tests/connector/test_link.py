"""The connector contract (`afd_ray.connector.link`): transport choice, the typed
error on a lost peer, bounded and releasable waits, and large messages, over real
sockets and shared memory on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from afd_ray.config import AFDConfig
from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import FFNAddress, HeaderKind, StepHeader
from afd_ray.connector.link import AttentionLink, FFNLink, PeerLostError
from afd_ray.connector.loopback import LoopbackFFN
from afd_ray.connector.transports import select_transport
from afd_ray.control.registry import Registry


def test_auto_picks_shm_on_one_node_and_the_backend_across_nodes() -> None:
    assert select_transport("auto", "gloo", same_node=True) == "shm"
    assert select_transport("auto", "gloo", same_node=False) == "gloo"
    assert select_transport("auto", "nccl", same_node=False) == "nccl"
    assert select_transport("auto", "nccl", same_node=True) == "cuda_ipc"  # GPUs of one node, one GPU included
    assert select_transport("gloo", "gloo", same_node=True) == "gloo"  # the config overrides auto
    with pytest.raises(ValueError, match="connector.transport: 'shm' cannot carry nccl"):
        select_transport("shm", "nccl", same_node=True)


@pytest.mark.parametrize(
    ("choice", "attention_node", "expected"),
    [("auto", "n1", "shm"), ("auto", "n2", "gloo"), ("auto", "", "gloo"), ("gloo", "n1", "gloo")],
)
def test_the_registry_resolves_each_pair_from_the_nodes_of_its_members(
    choice: str, attention_node: str, expected: str
) -> None:
    """An unknown node ("") never counts as the same node."""
    registry = Registry("gloo", 5.0, 1, choice)
    registry.add_ffn(FFNAddress("h0", 10, 11, node="n1"))
    member = registry.add_attention("r0", attention_node)
    assert registry.attention_assignment(member.rank).transport == expected


def test_config_rejects_a_transport_the_platform_cannot_use() -> None:
    assert AFDConfig.model_validate({"connector": {"transport": "shm"}}).connector.transport == "shm"
    with pytest.raises(ValidationError, match="connector.transport: 'nccl' cannot carry gloo"):
        AFDConfig.model_validate({"connector": {"transport": "nccl"}})
    with pytest.raises(ValidationError, match="transport"):
        AFDConfig.model_validate({"connector": {"transport": "tcp"}})


def test_step_header_carries_its_first_layer_in_40_bytes() -> None:
    header = StepHeader(HeaderKind.STEP, peer=1, epoch=2, step_id=3, num_tokens=16, first_layer=29)
    assert len(header.pack()) == 40
    assert StepHeader.unpack(header.pack()) == header


def test_channels_implement_the_contract_and_carry_prefill_sized_steps(
    transport: str, open_pair: Callable[..., AttentionChannel]
) -> None:
    """A `[4096, 576]` float32 step (9.4 MB, more than one shm slot) with top-k
    routing arrives bit for bit; the FFN side reports the pair's transport."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    attention = open_pair(ffn, 3, transport)
    assert isinstance(attention, AttentionLink) and isinstance(ffn, FFNLink)
    assert ffn.transport_of(3) == transport
    tokens, hidden_size, k = 4096, 576, 2
    x = torch.randn(tokens, hidden_size)
    ids = torch.randint(0, 8, (tokens, k))
    weights = torch.rand(tokens, k)

    loopback = LoopbackFFN(ffn, hidden_size, layers=1, answer=lambda layer, got: got * 2, top_k=k)
    server = threading.Thread(target=lambda: loopback.serve_step(ffn.recv_header(10)))
    server.start()
    attention.send_header(tokens)
    assert torch.equal(attention.exchange(x, (ids, weights)), x * 2)
    server.join(10)
    assert not server.is_alive() and loopback.topk is not None
    assert torch.equal(loopback.topk[0], ids) and torch.equal(loopback.topk[1], weights)
    attention.close()
    ffn.close()


def test_shm_wait_is_bounded_and_fails_with_the_typed_error(open_pair: Callable[..., AttentionChannel]) -> None:
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=0.5)
    attention = open_pair(ffn, 3, "shm", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="no shm message within 0.5 s") as error:
        ffn.recv_a2f(3, torch.empty(2, 8))
    assert error.value.peer == 3
    assert time.monotonic() - start < 5
    attention.close()
    ffn.close()


def test_close_releases_a_blocked_wait_at_once(transport: str, open_pair: Callable[..., AttentionChannel]) -> None:
    """The FFN never answers; closing the attention link from another thread ends
    the exchange with `PeerLostError` "pair closed" well before the 30 s timeout (a
    gloo receive used to wait out the timeout), and the FFN side then sees the pair
    closed at once too."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    attention = open_pair(ffn, 3, transport, timeout_s=30)
    errors: list[BaseException] = []

    def exchange() -> None:
        try:
            attention.exchange(torch.randn(2, 8))
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            errors.append(exc)

    waiter = threading.Thread(target=exchange)
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    attention.close()
    waiter.join(10)
    assert not waiter.is_alive() and len(errors) == 1, errors
    assert isinstance(errors[0], PeerLostError) and str(errors[0]).endswith("pair closed"), errors
    assert time.monotonic() - start < 5
    if transport == "shm":
        ffn.recv_a2f(3, torch.empty(2, 8))  # the A2F sent before the close still arrives
    with pytest.raises(PeerLostError):  # then (gloo: at once) the FFN sees the close
        ffn.recv_a2f(3, torch.empty(2, 8))
    assert time.monotonic() - start < 5
    ffn.close()


def test_a_wait_after_close_fails_as_pair_closed(transport: str, open_pair: Callable[..., AttentionChannel]) -> None:
    """A receive posted before `close()` and waited on after it, a new receive and a
    send after it: each fails at once with `PeerLostError` "pair closed", not with
    the closed socket's "Bad file descriptor" or an `IndexError` of the dropped slots
    (shm), nor after the 30 s timeout or with gloo's own error (gloo)."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    attention = open_pair(ffn, 3, transport, timeout_s=30)
    posted = attention.irecv_f2a(torch.empty(2, 8))
    attention.close()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="pair closed$") as error:
        posted.wait()
    assert error.value.peer == 3
    with pytest.raises(PeerLostError, match="pair closed$"):
        attention.irecv_f2a(torch.empty(2, 8)).wait()
    with pytest.raises(PeerLostError, match="pair closed$"):
        attention.isend_a2f(torch.randn(2, 8)).wait()
    assert time.monotonic() - start < 5
    ffn.close()
