"""One FFN process holding `cuda_ipc` pairs with two attention processes, opened one
after the other (2A:1F, or a re-peered attention rank), all on ONE GPU.

torch numbers its symmetric-memory store exchanges per process, so the FFN side's
second rendezvous used to wait for keys its fresh peer never wrote (2A:1F on an H200
timed out); `open_cuda_ipc_pair` now aligns the two sides first. Each pair then
exchanges one message (the FFN side answers `x + 1`), checked byte for byte.

The second test opens the second pair while the first one's flag wait is queued on
the FFN side's serving stream (a non-blocking stream, as `FFNRuntime` serves), for a
message its peer sends only once the second pair is open. An opening that waits for
that stream (as it did: torch's allocation synchronizes the current stream, and the
barrier was queued on it) fails after `SHORT_S` on every side (seen on an H200 without
MPS); it must pass. Skips visibly without CUDA.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from afd_ray.connector.cuda_ipc import CudaIpcPair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

TIMEOUT_S = 30.0
SHORT_S = 20.0
"""Bound on every store wait, rendezvous and device-side flag wait of the second
test; a pair open that waits for the serving stream fails after it (the device wait
traps)."""


def _side(rank: int, port: int, errors: mp.Queue) -> None:
    """Rank 0: the FFN side of both pairs; ranks 1, 2: one attention side each."""
    from afd_ray.connector.cuda_ipc import open_cuda_ipc_pair

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timedelta(seconds=TIMEOUT_S))
        if rank == 0:
            for peer in (1, 2):
                pair = open_cuda_ipc_pair("ffn", dist.PrefixStore(f"pair/{peer}", store), peer, 1, TIMEOUT_S)
                got = torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda")
                pair.recv([got], 0)
                pair.send([got + 1], 0)
                torch.cuda.synchronize()
                store.set(f"served/{peer}", "1")
            store.wait(["checked/1", "checked/2"], timedelta(seconds=TIMEOUT_S))  # the store's server lives here
        else:
            if rank == 2:  # the second pair opens once the first one served
                store.wait(["served/1"], timedelta(seconds=TIMEOUT_S))
            pair = open_cuda_ipc_pair("attention", dist.PrefixStore(f"pair/{rank}", store), rank, 1, TIMEOUT_S)
            _exchange_and_check(pair, rank, store, errors)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def _exchange_and_check(pair: CudaIpcPair, rank: int, store: dist.Store, errors: mp.Queue) -> None:
    """Attention rank `rank`: one exchange of random rows scaled by `rank`; the FFN side
    answers `x + 1`, checked byte for byte; then `checked/<rank>` in `store`."""
    sent = torch.randn(64, 2048, device="cuda").to(torch.bfloat16) * rank
    out = torch.empty_like(sent)
    pair.exchange([sent], [out], 0)
    torch.cuda.synchronize()
    if not torch.equal(out, sent + 1):
        errors.put(f"attention rank {rank}: wrong bytes back")
    store.set(f"checked/{rank}", "1")


def _opens_while_waiting(rank: int, port: int, errors: mp.Queue) -> None:
    """Rank 0: the FFN side; it opens its pair with attention rank 1, queues on its
    serving stream the wait for rank 1's message, then opens its pair with attention
    rank 2 on the same thread. Rank 1 sends only once that pair is open; rank 2 opens
    it once the wait is queued."""
    from afd_ray.connector.cuda_ipc import open_cuda_ipc_pair

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timedelta(seconds=SHORT_S))
        if rank == 0:
            first = open_cuda_ipc_pair("ffn", dist.PrefixStore("pair/1", store), 1, 1, SHORT_S)
            got = [torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            serving = torch.cuda.Stream()
            with torch.cuda.stream(serving):
                first.recv([got[0]], 0)
                store.set("waiting", "1")
                second = open_cuda_ipc_pair("ffn", dist.PrefixStore("pair/2", store), 2, 1, SHORT_S)
                store.set("opened/2", "1")
                first.send([got[0] + 1], 0)
                second.recv([got[1]], 0)
                second.send([got[1] + 1], 0)
            serving.synchronize()
            store.wait(["checked/1", "checked/2"], timedelta(seconds=SHORT_S))  # the store's server lives here
        else:
            if rank == 2:
                store.wait(["waiting"], timedelta(seconds=SHORT_S))
            pair = open_cuda_ipc_pair("attention", dist.PrefixStore(f"pair/{rank}", store), rank, 1, SHORT_S)
            if rank == 1:
                store.wait(["opened/2"], timedelta(seconds=SHORT_S))
            _exchange_and_check(pair, rank, store, errors)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def _run_sides(target: Callable[[int, int, mp.Queue], None], join_s: float) -> None:
    """Run `target(rank, port, errors)` in three fresh processes (one GPU); fail on any
    reported error, non-zero exit, or a process still running after `join_s` seconds."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    errors = context.Queue()
    procs = [context.Process(target=target, args=(rank, port, errors)) for rank in range(3)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + join_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == [] and all(proc.exitcode == 0 for proc in procs), (found, [p.exitcode for p in procs])


def test_one_ffn_process_pairs_with_two_fresh_attention_processes() -> None:
    _run_sides(_side, 120)


@pytest.mark.timeout(90)
def test_second_pair_opens_while_the_first_waits_on_the_device() -> None:
    _run_sides(_opens_while_waiting, 55)
