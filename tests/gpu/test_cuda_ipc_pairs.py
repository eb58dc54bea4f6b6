"""One FFN process holding `cuda_ipc` pairs with two attention processes, opened one
after the other (2A:1F, or a re-peered attention rank), all on ONE GPU.

torch numbers its symmetric-memory store exchanges per process, so the FFN side's
second rendezvous used to wait for keys its fresh peer never wrote (2A:1F on an H200
timed out); `open_cuda_ipc_pair` now aligns the two sides first. Each pair then
exchanges one message (the FFN side answers `x + 1`), checked byte for byte. Skips
visibly without CUDA.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

TIMEOUT_S = 30.0


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
            sent = torch.randn(64, 2048, device="cuda").to(torch.bfloat16) * rank
            out = torch.empty_like(sent)
            pair.exchange([sent], [out], 0)
            torch.cuda.synchronize()
            if not torch.equal(out, sent + 1):
                errors.put(f"attention rank {rank}: wrong bytes back")
            store.set(f"checked/{rank}", "1")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def test_one_ffn_process_pairs_with_two_fresh_attention_processes() -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    errors = context.Queue()
    procs = [context.Process(target=_side, args=(rank, port, errors)) for rank in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == [] and all(proc.exitcode == 0 for proc in procs), (found, [p.exitcode for p in procs])
