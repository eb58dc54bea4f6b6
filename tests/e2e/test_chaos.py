"""Chaos: SIGKILL the FFN replica's process while greedy streams run, twice in a row,
and the service comes back by itself; SIGKILL the coordinator and serving goes on;
SIGSTOP the FFN replica's process past `ffn.heartbeat_timeout_s`, then SIGCONT: the
coordinator removed it meanwhile, so it is fenced and replaced; then, scaled to 2A:2F
(EP2 over the two FFN ranks), SIGKILL one of the two FFN ranks, then one FFN rank and
the coordinator in the middle of its recovery, and SIGKILL one of the two attention
replicas: its streams resume on the other (a tiny Qwen3-MoE, float32, real Ray
cluster, real vLLM, real HTTP; one app for all, the tests run in this order).

What is checked, per FFN kill:
- a pause, not a request: every stream completes with exactly the tokens of the
  unfailed run (none lost, none repeated, no error); the attention rank blocked in
  the forward pass waits for its new FFN peer and repeats the current layer there;
  with EP the surviving FFN rank re-forms the EP group with the replacement under a
  new epoch, keeps its experts, and its attention rank repeats the layer too;
- every refused request during the recovery is a 503 with `Retry-After`;
- the coordinator records the loss (`/afd/status` `recoveries`): how it was found, the
  detection delay, the time until the FFN layout served again, the bytes reloaded;
- the layout is whole again (FFN target serving, the attention ranks READY on live
  FFN peers), `/afd/status` no longer lists the lost rank (the loss stays in
  `recoveries`), and a new request equals the unfailed run.

The bounds are asserted: the fault landed mid-stream (every stream has tokens before
and after its longest gap, and that gap ends after the fault), the pause (the longest
gap between two tokens of a stream) and the time until the layout is whole again.
"The unfailed run" is plain vLLM's greedy output of the same checkpoint (float32),
not an AFD run. The figures are also printed (run with -s to see them).
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

from chaos_faults import app_args, deployed
from chaos_faults import (
    ATTENTION_WHOLE_WITHIN_S,
    EP2_PAUSE_WITHIN_S,
    EP2_WHOLE_WITHIN_S,
    FFN_WHOLE_WITHIN_S,
    HEARTBEAT_S,
    KILLS,
    MID_RECOVERY_PAUSE_WITHIN_S,
    MID_RECOVERY_WHOLE_WITHIN_S,
    PAUSE_WITHIN_S,
    PROMPTS,
    REJOIN_WITHIN_S,
    REPLACED_WITHIN_S,
    RESUME_PAUSE_WITHIN_S,
    STOPPED_PAST_S,
    UNAFFECTED_PAUSE_WITHIN_S,
    WHOLE_WITHIN_S,
    _kill_ffn,
    _membership,
    _pause_s,
    _pid,
    _pids,
    _read_status,
    _Result,
    _scale_to_2a2f,
    _status,
    _stop_past_heartbeat,
    _stream,
    _wait_tokens,
    _whole,
)


@pytest.fixture(scope="module")
def chaos(serve_url: str, checkpoint: str, reference: list[list[int]]) -> Iterator[httpx.Client]:
    """The app (1A:1F to start, up to 2A:2F), deployed once plain vLLM's reference is
    computed (one engine at a time on the 2-core machine)."""
    with deployed(serve_url, app_args(checkpoint, 1, {"num_ranks": 1, "heartbeat_timeout_s": HEARTBEAT_S})) as http:
        yield http


def test_ffn_sigkill_costs_no_hang_and_the_service_comes_back(chaos: httpx.Client, reference: list[list[int]]) -> None:
    figures = [_kill_ffn(chaos, reference, _pid("ffn")) for _ in range(KILLS)]
    print("\nFFN chaos (1A:1F tiny Qwen3-MoE, float32, CPU):")
    for kill, row in enumerate(figures, 1):
        print("  " + json.dumps({"kill": kill} | row))


def test_coordinator_sigkill_does_not_stop_serving(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """Serve restarts the coordinator; the members rejoin it with their ranks, peers,
    epochs and layout; the streams running meanwhile complete unchanged."""
    before = _status(chaos)
    assert before is not None and _whole(chaos), before
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(chaos, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pid("coordinator"), signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    assert [r.tokens for r in results] == reference and all(r.error is None for r in results), results
    pause_s = _pause_s(results, killed, paused=False)
    assert pause_s <= UNAFFECTED_PAUSE_WITHIN_S, pause_s
    while True:  # bounded: wait until the members have rejoined the new coordinator
        after = _status(chaos)
        if after is not None and _membership(after) == _membership(before) and _whole(chaos):
            break
        assert time.monotonic() - killed < REJOIN_WITHIN_S, (_membership(before), after and _membership(after))
        time.sleep(0.5)
    rejoined_s = time.monotonic() - killed
    again = _Result()
    _stream(chaos, 1, again)
    assert again.error is None and again.tokens == reference[1], again
    print(f"\ncoordinator SIGKILL: longest gap {pause_s:.2f} s, members rejoined within {rejoined_s:.1f} s")


def test_ffn_sigstop_past_the_heartbeat_is_fenced_and_replaced(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """SIGSTOP the FFN rank during 4 greedy streams until the coordinator found it dead
    by its missed heartbeat, then SIGCONT: it is fenced (it stops serving and fails its
    health check), Serve replaces it, the layout is re-formed with the replacement,
    and every stream equals the unfailed run. Before, the resumed rank kept its
    replica, its loop and its attention pair under its old epoch while `/afd/status`
    listed it `gone`, and 60 s after SIGCONT Serve still ran it."""
    pid = _pid("ffn")
    stopped_s = HEARTBEAT_S + STOPPED_PAST_S  # the streams pause at least this long
    row = _kill_ffn(
        chaos,
        reference,
        pid,
        fault=_stop_past_heartbeat,
        pause_within_s=stopped_s + PAUSE_WITHIN_S,
        whole_within_s=stopped_s + REPLACED_WITHIN_S + FFN_WHOLE_WITHIN_S,
    )
    assert "ffn.heartbeat_timeout_s" in row["cause"], row
    assert pid not in _pids("ffn")
    print("\nFFN SIGSTOP past the heartbeat, then SIGCONT (1A:1F): " + json.dumps(row))


def test_ep2_ffn_sigkill_the_survivor_reforms_the_ep_group(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """2A:2F, EP2: SIGKILL one of the two FFN ranks during 4 greedy streams. The
    survivor's EP collective fails: it closes its attention pairs and waits; the
    coordinator re-forms the EP group from the survivor (same EP rank, no reload) and
    the replacement Serve starts (it loads the lost shard) under a new epoch, and
    re-peers both attention ranks; each repeats its current layer there. Meanwhile
    `/afd/status` says the survivor's loop is `ep_lost`, then `serving` again."""
    _scale_to_2a2f(chaos)
    before = _read_status(chaos)
    survivors = {m["rank"]: m["ep_rank"] for m in before["ffn"] if m["state"] == "ready"}
    assert len(survivors) == 2 and sorted(survivors.values()) == [0, 1], before["ffn"]
    loops: dict[int, set[str | None]] = {rank: set() for rank in survivors}
    done = threading.Event()

    def sample() -> None:  # what /afd/status says each FFN rank's loop does, meanwhile
        while not done.wait(0.3):
            for member in (_status(chaos) or {}).get("ffn", []):
                if member["rank"] in loops:
                    loops[member["rank"]].add(member["loop"])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        row = _kill_ffn(
            chaos, reference, _pids("ffn")[0], pause_within_s=EP2_PAUSE_WITHIN_S, whole_within_s=EP2_WHOLE_WITHIN_S
        )
    finally:
        done.set()
        sampler.join()
    (lost,) = row["lost"]
    after = _read_status(chaos)
    ranks = {m["rank"]: m["ep_rank"] for m in after["ffn"] if m["state"] == "ready" and m["ep_rank"] is not None}
    survivor = next(r for r in survivors if r != lost)
    assert len(ranks) == 2 and ranks[survivor] == survivors[survivor], (survivors, ranks)  # kept its experts
    # truthful while its EP group was lost (it said `serving` before), serving again once re-formed
    assert "ep_lost" in loops[survivor], loops
    assert next(m["loop"] for m in after["ffn"] if m["rank"] == survivor) == "serving", after["ffn"]
    print(f"\nFFN chaos (2A:2F EP2 tiny Qwen3-MoE, float32, CPU; EP rank {survivors[lost]} killed):")
    print("  " + json.dumps(row))


def test_ep2_coordinator_sigkill_mid_recovery_reforms_the_layout(
    chaos: httpx.Client, reference: list[list[int]]
) -> None:
    """2A:2F, EP2: SIGKILL one FFN rank during 4 greedy streams, then the coordinator
    as soon as it has recorded the loss (before the re-formed layout switched). The
    restarted coordinator learns from the rejoining survivor its layout and that its
    EP group is lost, records the lost rank, gives Serve's replacement a new id and
    re-forms the layout; every stream equals the unfailed run. Before, the survivor
    alone could not re-form its rejoined layout (the dead EP rank never rejoins), so
    the layout stayed empty and nothing recovered it."""
    _scale_to_2a2f(chaos)
    before = _read_status(chaos)
    known = {m["rank"] for m in before["ffn"]}
    results = [_Result() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(chaos, i, r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pids("ffn")[0], signal.SIGKILL)
    killed = time.monotonic()
    while True:  # bounded: until the coordinator recorded the loss
        status = _status(chaos)
        if status is not None and len(status["recoveries"]) > len(before["recoveries"]):
            break
        assert time.monotonic() - killed < 60, status
        time.sleep(0.1)
    event = status["recoveries"][-1]
    assert event["whole_s"] is None, event  # the layout did not switch yet
    os.kill(_pid("coordinator"), signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for prompt, result in enumerate(results):
        assert result.error is None and result.tokens == reference[prompt], (prompt, result)
    pause_s = _pause_s(results, killed)
    while not _whole(chaos):
        assert time.monotonic() - killed < WHOLE_WITHIN_S, _status(chaos)
        time.sleep(0.5)
    whole_s = time.monotonic() - killed
    assert pause_s <= MID_RECOVERY_PAUSE_WITHIN_S and whole_s <= MID_RECOVERY_WHOLE_WITHIN_S, (pause_s, whole_s)
    after = _read_status(chaos)
    (lost,) = event["lost"]
    ranks = {m["rank"]: m["ep_rank"] for m in after["ffn"] if m["state"] == "ready"}
    (replacement,) = set(ranks) - known
    assert lost not in ranks and replacement > max(known), (known, ranks)
    reformed = after["recoveries"][-1]  # the restarted coordinator's record of the same loss
    assert reformed["lost"] == [lost] and reformed["error"] is None and reformed["whole_s"] is not None, reformed
    again = _Result()
    _stream(chaos, 2, again)
    assert again.error is None and again.tokens == reference[2], again
    print(
        f"\nFFN + coordinator SIGKILL mid-recovery (2A:2F EP2): FFN rank {lost} lost, replacement rank "
        f"{replacement}; streams equal to the unfailed run, longest gap {pause_s:.1f} s; whole again "
        f"{whole_s:.1f} s after the FFN kill; restarted coordinator's record: {json.dumps(reformed)}"
    )


ATTENTION_STREAMS = 6


def test_attention_sigkill_streams_resume_on_another_rank(chaos: httpx.Client, reference: list[list[int]]) -> None:
    """2A:2F; SIGKILL one attention replica while 6 greedy streams run: the ingress
    moves the killed rank's streams to the other rank (prompt + tokens already sent,
    re-prefilled), and every stream equals the unfailed run, without error or repeat;
    the killed rank's FFN peer drops it mid-step and keeps serving its EP group (no
    FFN recovery); Serve replaces the killed rank and the layout is whole again."""
    _scale_to_2a2f(chaos)
    recoveries = len(_read_status(chaos)["recoveries"])
    resumed_before = _read_status(chaos)["admission"]["resumed"]
    results = [_Result() for _ in range(ATTENTION_STREAMS)]
    threads = [threading.Thread(target=_stream, args=(chaos, i % len(PROMPTS), r)) for i, r in enumerate(results)]
    for thread in threads:
        thread.start()
    _wait_tokens(results)
    os.kill(_pids("attention")[0], signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a stream hung"
    for i, result in enumerate(results):
        assert result.error is None and result.tokens == reference[i % len(PROMPTS)], (i, result)
    pause_s = _pause_s(results, killed, paused=False)  # only the killed rank's streams pause
    status = _read_status(chaos)
    resumed = status["admission"]["resumed"] - resumed_before
    deadline = time.monotonic() + WHOLE_WITHIN_S  # Serve's replacement rank READY (no replica left starting)
    while not _whole(chaos):
        assert time.monotonic() < deadline, _status(chaos)
        time.sleep(0.5)
    whole_s = time.monotonic() - killed
    print(
        f"\nattention SIGKILL (2A:2F): {resumed} of {ATTENTION_STREAMS} streams resumed on the other rank, "
        f"all equal to the unfailed run; longest inter-token gap {pause_s:.2f} s; "
        f"FFN recoveries meanwhile: {len(status['recoveries']) - recoveries}; "
        f"2A:2F whole again {whole_s:.1f} s after the kill"
    )
    assert pause_s <= RESUME_PAUSE_WITHIN_S and whole_s <= ATTENTION_WHOLE_WITHIN_S, (pause_s, whole_s)
    assert resumed >= 1  # streams ran on the killed rank (Serve spreads them over both)
    assert len(status["recoveries"]) == recoveries, status["recoveries"][recoveries:]  # no FFN rank was lost
