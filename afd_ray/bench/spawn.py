"""The two rank processes of a GPU pair benchmark (`afd_ray.bench.decode`, `decode_nvlink`)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable

import torch.multiprocessing as mp

__all__ = ["free_port", "run_pair"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pair(target: Callable[[int, argparse.Namespace, int], None], args: argparse.Namespace) -> None:
    """Run `target(rank, args, port)` for ranks 0 and 1 in spawned processes; `port` is one
    free port for their rendezvous. NVLink multicast (NCCL NVLS, symmetric-memory
    multicast, NVSHMEM NVLS) is off unless the environment already sets it. When one rank
    exits non-zero the other is terminated (it would wait on its peer until its timeout).
    Exits with status 1 (`SystemExit`) if either rank failed."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=target, args=(rank, args, port)) for rank in range(2)]
    for proc in procs:
        proc.start()
    while any(proc.is_alive() for proc in procs):
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
        time.sleep(0.2)
    if any(proc.exitcode != 0 for proc in procs):
        sys.exit(1)
