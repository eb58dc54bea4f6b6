"""The coordinator sees an FFN rank's process end through the connection it holds to
the rank's store (`afd_ray.control.liveness`), without Ray: a real `TCPStore` in a
process of its own, SIGKILLed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from afd_ray.connector.header import FFNAddress
from afd_ray.control.liveness import ProcessWatch
from afd_ray.control.membership import FFNMember, MemberState

ENDED_WITHIN_S = 1.0
"""Bound on seeing a SIGKILLed process end (milliseconds on one node; margin for a loaded machine)."""

_STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def test_a_killed_rank_is_seen_at_once_and_its_store_keeps_working_while_watched() -> None:
    rank = subprocess.Popen([sys.executable, "-c", _STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(rank.stdout.readline())
        member = FFNMember(rank=0, address=FFNAddress("127.0.0.1", port, port + 1))
        refused = FFNMember(rank=1, address=FFNAddress("127.0.0.1", 1, 2))  # nothing listens: proves nothing

        async def run() -> float:
            watch = ProcessWatch()
            watch.follow({0: member, 1: refused})
            await asyncio.sleep(1.0)
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
            client.set("pair", b"open")  # the idle watcher disturbs no rendezvous
            assert client.get("pair") == b"open" and watch.ended == {}
            killed = time.monotonic()
            rank.kill()
            await asyncio.wait_for(watch.changed.wait(), ENDED_WITHIN_S)
            seen_s = time.monotonic() - killed
            assert list(watch.ended) == [0] and "process ended" in watch.ended[0], watch.ended
            watch.follow({0: member.model_copy(update={"state": MemberState.GONE}), 1: refused})
            assert watch.ended == {}  # a GONE rank is forgotten
            return seen_s

        seen_s = asyncio.run(run())
        print(f"\nSIGKILLed rank's process seen ended after {seen_s * 1000:.0f} ms")
    finally:
        rank.kill()
        rank.wait(10)
