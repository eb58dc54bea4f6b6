"""The per-transport data plane (`afd_ray.connector.pair.Pair`): each CPU transport's
pair, opened by its own function as the channels open it, is a `Pair` and carries a
message and its answer bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from afd_ray.connector.group_pair import open_group_pair
from afd_ray.connector.pair import Pair, Side
from afd_ray.connector.shm import open_shm_pair


def _opener(transport: str) -> Callable[[Side, dist.Store], Pair]:
    if transport == "shm":
        return lambda side, store: open_shm_pair(side, store, peer=0, ubatches=1, timeout_s=10)
    return lambda side, store: open_group_pair(side, store, peer=0, ubatches=1, timeout_s=10, backend="gloo")


def test_each_cpu_transport_opens_a_pair_that_exchanges_exact_bytes(transport: str) -> None:
    store = dist.HashStore()
    opened: dict[str, Pair] = {}
    ffn_side = threading.Thread(target=lambda: opened.update(ffn=_opener(transport)("ffn", store)))
    ffn_side.start()
    attention = _opener(transport)("attention", store)
    ffn_side.join(10)
    ffn = opened["ffn"]
    assert isinstance(attention, Pair) and isinstance(ffn, Pair)
    hidden, ids = torch.randn(5, 8), torch.randint(0, 8, (5, 2))
    got_hidden, got_ids, answer = torch.empty_like(hidden), torch.empty_like(ids), torch.empty_like(hidden)

    def serve() -> None:
        ffn.recv([got_hidden, got_ids], 0).wait()
        ffn.send([got_hidden * 2], 0).wait()

    server = threading.Thread(target=serve)
    server.start()
    attention.exchange([hidden, ids], [answer], 0)
    server.join(10)
    assert torch.equal(got_ids, ids) and torch.equal(answer, hidden * 2)
    attention.close()
    ffn.close()
    with pytest.raises(RuntimeError, match="pair closed"):
        attention.recv([answer], 0).wait()


def test_the_cuda_ipc_host_barrier_keeps_its_tensors_on_the_host_under_another_default_device() -> None:
    """vLLM's GPU worker connects the model under a CUDA default device; the cuda_ipc
    pair's gloo all-gather made its tensors there and gloo refused them (every served
    cuda_ipc pair failed on the H100 run of 2026-12-07). A meta default device is the
    same trap on CPU."""
    from afd_ray.connector.cuda_ipc import _allgather

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with torch.device("meta"):
        assert _allgather(group, 7) == [7]
