"""An FFN peer that dies inside a forward pass costs a pause, not the pass: the
attention side's `FFNClient` gets `PeerLostError`, asks its server's rescue endpoint
for the new peer, joins it, announces the rest of the step from the current layer and
repeats that layer's exchange. Real connector (shm and gloo), real FFN runtimes in
threads, a real ZeroMQ rescue endpoint; the oracle is the FFN stack called directly.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zmq

from afd_ray.attention.ffn_client import FFNClient
from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.header import HeaderKind
from afd_ray.connector.link import PeerLostError
from afd_ray.control.membership import AttentionAssignment
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny

TOKENS = 5
LOST_AT = 1
"""The layer whose exchange the first FFN peer never answers (it dies after the A2F)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> FFNStack:
    checkpoint = build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return load_ffn_stack(Path(checkpoint), torch.float32, torch.device("cpu"))


def _assignment(channel: FFNChannel, epoch: int, transport: str, rescue: str, wait_s: float) -> AttentionAssignment:
    address = channel.address
    return AttentionAssignment(
        peer=0,
        ffn_rank=epoch,
        host=address.host,
        store_port=address.store_port,
        control_port=address.control_port,
        epoch=epoch,
        transport=transport,
        timeout_s=10,
        rescue=rescue,
        peer_lost_wait_s=wait_s,
    )


def _dying_peer(channel: FFNChannel, hidden_size: int) -> None:
    """An FFN rank that admits the peer, serves layer 0 of its step, receives layer
    `LOST_AT`'s A2F and dies (closes everything) without answering."""
    join = channel.recv_header(10)
    assert join is not None and join.kind is HeaderKind.JOIN
    channel.admit(join.peer)
    step = channel.recv_header(10)
    assert step is not None and step.kind is HeaderKind.STEP
    rows = torch.empty(step.num_tokens, hidden_size)
    for layer in range(LOST_AT + 1):
        channel.recv_a2f(join.peer, rows)
        if layer < LOST_AT:
            channel.send_f2a(join.peer, rows * 0)  # layer 0's answer (checked against 0 below)
    channel.close()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_pass_resumes_on_the_new_peer(stack: FFNStack, transport: str) -> None:
    dying = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    spare = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    runtime = FFNRuntime(stack, spare, torch.float32, poll_s=0.05, batch_window_s=0.01)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    server = zmq.Context.instance().socket(zmq.REP)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    rescue = f"tcp://127.0.0.1:{port}"
    held: list[AttentionAssignment] = []

    def answer_rescue() -> None:  # the AttentionServer's part: the coordinator's next assignment
        held.append(AttentionAssignment.model_validate_json(server.recv_string()))
        server.send_string(_assignment(spare, 1, transport, rescue, 10).model_dump_json())

    helpers = [
        threading.Thread(target=_dying_peer, args=(dying, stack.hidden_size)),
        threading.Thread(target=answer_rescue),
    ]
    for helper in helpers:
        helper.start()
    try:
        client = FFNClient(_assignment(dying, 0, transport, rescue, 10))
        hidden = torch.randn(TOKENS, stack.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            client.begin_step(TOKENS)
            outs = [client.exchange(hidden * (layer + 1), layer) for layer in range(stack.num_layers)]
            expected = [stack(layer, hidden * (layer + 1)) for layer in range(stack.num_layers)]
        assert torch.equal(outs[0], torch.zeros_like(outs[0]))  # served by the peer that then died
        for layer in range(LOST_AT, stack.num_layers):  # repeated/continued on the new peer: exact
            torch.testing.assert_close(outs[layer], expected[layer], rtol=1e-5, atol=1e-5)
        assert held[0].epoch == 0 and client.assignment.epoch == 1 and client.resumes == 1
        client.begin_step(TOKENS)  # the next pass runs on the new peer from its first layer
        with torch.inference_mode():
            again = client.exchange(hidden, 0)
        torch.testing.assert_close(again, stack(0, hidden), rtol=1e-5, atol=1e-5)
        client.link.close()
    finally:
        for helper in helpers:
            helper.join(10)
        runtime.stop()
        loop.join(10)
        server.close()


def test_no_new_peer_within_the_bound_raises(stack: FFNStack) -> None:
    dying = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    helper = threading.Thread(target=_dying_peer, args=(dying, stack.hidden_size))
    helper.start()
    server = zmq.Context.instance().socket(zmq.REP)  # never answers
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = FFNClient(_assignment(dying, 0, "shm", f"tcp://127.0.0.1:{port}", 0.5))
        hidden = torch.randn(TOKENS, stack.hidden_size)
        with torch.inference_mode():
            client.begin_step(TOKENS)
            client.exchange(hidden, 0)
            with pytest.raises(PeerLostError, match="connector.peer_lost_wait_s"):
                client.exchange(hidden, LOST_AT)
    finally:
        helper.join(10)
        server.close()
