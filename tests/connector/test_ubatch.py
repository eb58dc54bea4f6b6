"""DBO (two-ubatch) schedule and bucketed receive buffers over each CPU transport (gloo pair groups, shm slots)."""

from __future__ import annotations

import threading

import pytest
import torch

from afd_ray.connector.buffers import RecvBuffers
from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import HeaderKind
from afd_ray.connector.ubatch import attention_layers, ffn_layers, ubatch_slices

H = 8
LAYERS = 3


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs over each CPU transport of the connector contract."""
    return request.param


def test_ubatch_slices_cover_the_rows_evenly():
    assert ubatch_slices(5, 2) == [slice(0, 3), slice(3, 5)]
    assert ubatch_slices(4, 1) == [slice(0, 4)]
    with pytest.raises(ValueError, match="cannot split"):
        ubatch_slices(1, 2)


def test_recv_buffers_reuse_one_allocation_per_bucket_and_slot():
    buffers = RecvBuffers([128, 1, 16], H, torch.float32, torch.device("cpu"), slots=2)
    assert buffers.buckets == [1, 16, 128]
    assert buffers.bucket(16) == 16 and buffers.bucket(17) == 128
    first = buffers.get(5, slot=1)
    assert first.shape == (5, H)
    assert buffers.get(12, slot=1).data_ptr() == first.data_ptr()
    assert buffers.get(12, slot=0).data_ptr() != first.data_ptr()
    with pytest.raises(ValueError, match="outside the buckets"):
        buffers.get(129)


def _ffn(layer: int, hidden: torch.Tensor) -> torch.Tensor:
    return hidden * (layer + 2) + 1


def _step(num_ubatches: int, channel: AttentionChannel | None, x: torch.Tensor) -> torch.Tensor:
    """One step of an elementwise toy decoder (so row splits cannot change the numbers)."""
    residual = x.clone()
    slices = ubatch_slices(x.shape[0], num_ubatches)
    recv = [torch.empty(s.stop - s.start, H) for s in slices]

    def attend(layer: int, u: int) -> torch.Tensor:
        rows = residual[slices[u]]
        rows += torch.tanh(rows) * (layer + 1)
        return rows / (rows.abs().amax(dim=-1, keepdim=True) + 1)

    def finish(layer: int, u: int, out: torch.Tensor) -> None:
        residual[slices[u]] += out

    if channel is None:
        attention_layers(LAYERS, attend, finish, recv, ffn=_ffn)
    else:
        attention_layers(LAYERS, attend, finish, recv, channel=channel)
    return residual


def test_dbo_schedule_over_two_pair_groups_matches_the_colocated_step(transport: str):
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10, ubatch_groups=2)
    sizes = [7, 1, 16]  # steps served with DBO on, DBO off, DBO on

    def serve() -> None:
        join = ffn.recv_header(10)
        assert join.kind is HeaderKind.JOIN
        ffn.admit(join.peer)
        for num_ubatches in (2, 1, 2):
            header = ffn.recv_header(10)
            recv = [torch.empty(s.stop - s.start, H) for s in ubatch_slices(header.num_tokens, num_ubatches)]
            ffn_layers(LAYERS, _ffn, recv, ffn, header.peer)

    server = threading.Thread(target=serve)
    server.start()
    attention = AttentionChannel(ffn.address, 0, 0, transport, timeout_s=10, ubatch_groups=2)
    for tokens, num_ubatches in zip(sizes, (2, 1, 2), strict=True):
        x = torch.randn(tokens, H)
        attention.send_header(tokens)
        assert torch.equal(_step(num_ubatches, attention, x), _step(1, None, x))
    server.join(10)
    assert not server.is_alive()
    attention.close()
    ffn.close()


def test_attention_layers_needs_exactly_one_ffn_path():
    with pytest.raises(ValueError, match="exactly one"):
        attention_layers(
            1, lambda layer, u: torch.zeros(1, H), lambda layer, u, out: None, [torch.empty(1, H)]
        )
    with pytest.raises(ValueError, match="ubatch_groups"):
        FFNChannel("127.0.0.1", "gloo", timeout_s=1, ubatch_groups=0)
