"""A fenced FFN rank closes its EP group: two EP ranks (threads of this process, real
gloo collectives, a tiny Qwen3-MoE); the coordinator fences rank 1 (`FFNServer`
stops its loop), and rank 0 finds its EP group lost at once, not after the group's
`timeout_s`.

Before, a stopped loop closed its attention channel but left its EP group open: the
other EP ranks' next collective waited the full timeout for a rank that would never
take part again, and only then did their recovery start.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from afd_ray.models.tiny import build_tiny
from ep_pair import ep_pair

TIMEOUT_S = 30
IDLE_POLL_S = 0.02


def test_a_stopped_ep_rank_closes_its_group_so_the_others_fail_fast(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    runtimes = ep_pair(checkpoint, TIMEOUT_S, IDLE_POLL_S, ep_lost_wait_s=TIMEOUT_S)
    loops = {rank: threading.Thread(target=runtime.run) for rank, runtime in runtimes.items()}
    for loop in loops.values():
        loop.start()
    try:
        time.sleep(0.5)  # the idle group checks in with each other
        assert not runtimes[0].ep_lost
        runtimes[1].stop()  # fenced
        loops[1].join(TIMEOUT_S)
        stopped = time.monotonic()
        while not runtimes[0].ep_lost:
            assert time.monotonic() - stopped < TIMEOUT_S / 3, "rank 0 still waits on the fenced rank's EP group"
            time.sleep(0.01)
        assert loops[0].is_alive()  # it waits for the re-formed layout
    finally:
        for rank, runtime in runtimes.items():
            runtime.stop()
            loops[rank].join(TIMEOUT_S)
