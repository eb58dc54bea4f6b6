"""Standby FFN ranks (`ffn.standby_ranks: 1`, issue 33): SIGKILL the serving FFN rank
while 4 greedy streams run, and the standby, started, loaded and registered outside
the layout, takes its place under a new epoch at once; Serve's replacement replica
then stands by in its place. Twice at 1A:1F, then once at 2A:2F with EP2 (the grow
itself takes the standby in, and the standby takes any EP rank: it holds every
expert). A tiny Qwen3-MoE, float32, real Ray cluster, real vLLM, real HTTP; one app
for all (named as the chaos module's, which is deleted before this one deploys).

What is checked, per kill:
- every stream completes with plain vLLM's greedy tokens (none lost or repeated, no
  error), and the fault landed mid-stream (tokens before and after its longest gap);
- the pause (the longest gap between two tokens of a stream) and the time from the
  kill until the layout is whole again (FFN target serving, attention ranks READY
  and re-peered) are within the bounds below on the 2-core CI machine;
- the standby is the rank that took the lost rank's EP rank, and it loaded nothing
  from the checkpoint (`bytes_loaded` 0);
- Serve's replacement registers as the new standby (state `standby` in `/afd/status`,
  the layout and the targets unchanged).
The figures are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import ray
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from chaos_faults import app_args, deployed
from chaos_faults import (
    KILLS,
    NAME,
    PROMPTS,
    WHOLE_WITHIN_S,
    _pause_s,
    _read_status,
    _Result,
    _scale_to_2a2f,
    _stream,
    _wait_tokens,
    _whole,
)

STANDBY_PAUSE_WITHIN_S = 3.0
"""Bound on the pause of a stream through an FFN SIGKILL with a standby rank (1A:1F),
issue 33's: the coordinator sees the process end (its store connection closes), plans
the layout with the standby, which gets the plan at its next report and serves it by
the one after (every 0.2 s); the attention rank learns its new peer at its next poll
(every 0.5 s) and repeats its layer there. Measured 1.2 s on the 2-core machine."""

STANDBY_WHOLE_WITHIN_S = 5.0
"""Bound on the layout being whole again after that kill (from the kill), issue 33's."""

EP2_STANDBY_PAUSE_WITHIN_S = 5.0
"""Bound on the pause through an FFN SIGKILL at 2A:2F EP2 with a standby: as above,
plus the survivor's failed EP collective and the EP group re-formed with the standby
(which copies the lost EP rank's experts from the ones it holds); issue 33's.
Measured 1.9 s."""

EP2_STANDBY_WHOLE_WITHIN_S = 10.0
"""Bound on 2A:2F EP2 being whole again after that kill (from the kill)."""

STANDBY_BACK_WITHIN_S = 180
"""Cap on waiting for Serve's replacement replica to stand by (a new process imports
torch and vLLM and loads every expert); not a bound the tests assert."""


@pytest.fixture(scope="module")
def standby(serve_url: str, checkpoint: str, reference: list[list[int]]) -> Iterator[httpx.Client]:
    """The app: 1A:1F with one FFN standby rank to start, up to 2A:2F."""
    with deployed(serve_url, app_args(checkpoint, 1, {"num_ranks": 1, "standby_ranks": 1})) as http:
        yield http


def _ffn_pids() -> dict[str, int]:
    """The process id of each RUNNING FFN replica, by Serve replica id."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_deployment_details.remote(NAME, "ffn"))
    return {r.replica_id: r.pid for r in details.replicas if r.state.value == "RUNNING"}


def _standing_by(status: dict) -> list[dict]:
    """The FFN members standing by, loaded and listening (they have reported)."""
    return [m for m in status["ffn"] if m["state"] == "standby" and m["loop"] == "serving"]


def _until_standby(http: httpx.Client) -> dict:
    """`/afd/status` once the layout is whole and its one standby is loaded (bounded)."""
    deadline = time.monotonic() + STANDBY_BACK_WITHIN_S
    while True:
        status = _read_status(http)
        if status["target_standby"] == 1 and len(_standing_by(status)) == 1 and _whole(http):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def _kill_with_standby(
    http: httpx.Client, reference: list[list[int]], ep_rank: int, pause_within_s: float, whole_within_s: float
) -> dict:
    """SIGKILL the FFN rank of EP rank `ep_rank` while 4 greedy streams run, with one
    standby loaded; check the streams, the bounds, the takeover and the new standby;
    returns the figures."""
    before = _until_standby(http)
    (spare,) = _standing_by(before)
    (victim,) = [m for m in before["ffn"] if m["state"] == "ready" and m["ep_rank"] == ep_rank]
    pid = _ffn_pids()[victim["replica"]]
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(http, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    whole_at: list[float] = []
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def sample() -> None:  # the first time the layout is whole again after the kill
        while time.monotonic() - killed < WHOLE_WITHIN_S:
            status = _read_status(http)
            recovered = len(status["recoveries"]) > len(before["recoveries"])
            if recovered and status["recoveries"][-1]["whole_s"] is not None and _whole(http):
                whole_at.append(time.monotonic())
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for thread in threads:
        thread.join(120)
    sampler.join(WHOLE_WITHIN_S)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for prompt, result in enumerate(results):  # a pause, not a request: all complete, none repeated
        assert result.error is None and result.tokens == reference[prompt], (prompt, result)
    pause_s = _pause_s(results, killed)
    assert whole_at, _read_status(http)
    whole_s = whole_at[0] - killed
    after = _read_status(http)
    event = after["recoveries"][-1]
    assert event["lost"] == [victim["rank"]] and event["error"] is None, event
    took = next(m for m in after["ffn"] if m["rank"] == spare["rank"])
    assert took["state"] == "ready" and took["ep_rank"] == ep_rank, after["ffn"]  # the standby took its place
    assert event["bytes_loaded"] == 0, event  # it held every expert: nothing read from the checkpoint
    figures = {
        "lost": victim["rank"],
        "standby_took_over": spare["rank"],
        "max_gap_s": round(pause_s, 3),
        "whole_s": round(whole_s, 2),
        "detected_after_s": round(event["since_report_s"], 3),
        "cause": event["cause"],
        "ffn_layout_back_s": round(event["whole_s"], 2),
        "bytes_reloaded": event["bytes_loaded"],
    }
    print("  " + json.dumps(figures))
    assert pause_s <= pause_within_s and whole_s <= whole_within_s, figures
    replaced = _until_standby(http)  # Serve's replacement replica stands by in the standby's place
    (new,) = _standing_by(replaced)
    assert new["rank"] > max(m["rank"] for m in before["ffn"]) and new["ep_rank"] is None, replaced["ffn"]
    assert (replaced["target_attention"], replaced["target_ffn"]) == (before["target_attention"], before["target_ffn"])
    return figures


def test_ffn_sigkill_the_standby_takes_over_at_once(standby: httpx.Client, reference: list[list[int]]) -> None:
    """1A:1F with one standby: two FFN SIGKILLs in a row, each with the pause and the
    whole-again bounds of a standby takeover; the standby counts in no pool size."""
    print("\nFFN SIGKILL with a standby (1A:1F, tiny Qwen3-MoE, float32, CPU):")
    for _ in range(KILLS):
        _kill_with_standby(standby, reference, 0, STANDBY_PAUSE_WITHIN_S, STANDBY_WHOLE_WITHIN_S)
    status = _read_status(standby)
    assert sum(m["state"] != "gone" for m in status["ffn"]) == 2 and status["metrics"] is not None, status


def test_ep2_ffn_sigkill_the_standby_takes_the_lost_ep_rank(standby: httpx.Client, reference: list[list[int]]) -> None:
    """Scaled to 2A:2F (EP2): the grow takes the standby in, and Serve's new replica
    stands by. SIGKILL EP rank 1's FFN rank during 4 greedy streams: the standby takes
    EP rank 1 (it copies that shard from the experts it holds), the survivor keeps EP
    rank 0, and both attention ranks repeat their layer on the re-formed layout."""
    _scale_to_2a2f(standby)
    print("\nFFN SIGKILL with a standby (2A:2F EP2, tiny Qwen3-MoE, float32, CPU):")
    _kill_with_standby(standby, reference, 1, EP2_STANDBY_PAUSE_WITHIN_S, EP2_STANDBY_WHOLE_WITHIN_S)
