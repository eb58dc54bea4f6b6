"""Expert load balancing across the FFN pool while serving (EPLB), through the real
application: a tiny Qwen3-MoE whose routers send most rows to two experts per layer,
both in EP rank 0's contiguous block (`build_tiny(skew=...)`), served 2A:2F with EP2
(up to 3 FFN ranks), under four concurrent greedy streams; every request must finish
with exactly plain vLLM's tokens and no error. In this order, on one app:

1. an FFN rank is SIGKILLed while the ranks prepare a rebalance's layout: the
   rebalance fails at once (409), the recovery re-forms the layout from the survivor
   and Serve's replacement (the contiguous blocks: EPLB was not in use yet), every
   rank serves the same epoch, and no request is lost;
2. while the streams run, `POST /afd/eplb {"num_redundant_experts": 0}` moves the
   experts without replicas, then `POST /afd/eplb` with the configured 2 replicates
   the hot ones; over a window of FFN steps before, between and after, the
   balancedness in `/afd/status` rises from the skewed placement's to near 1 and the
   slowest FFN rank's share of the routed rows and of the ranks' compute
   (`compute_s`, EP collectives excluded) falls towards 1/2;
3. resized to 3 FFN ranks, the new layout keeps the placement policy (the policy's
   placement for 3 ranks, not the contiguous blocks); `POST /afd/eplb` during the
   resize answers 409 and changes nothing.

The policy's own trigger and the placement of new layouts are tested without Ray
(`tests/eplb/`), the body of `POST /afd/eplb` in tests/serve/test_eplb_body_unit.py.
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
from chaos_faults import PROMPTS, WHOLE_WITHIN_S, _pids, _status, _whole, app_args, deployed, greedy_reference

from afd_ray.models.tiny import build_tiny

MAX_TOKENS = 16
"""Tokens per request (the reference has more: greedy, so its first 16 are these)."""
STREAMS = 4
SKEW = 3.0
"""Router skew of the checkpoint: contiguous EP2 balancedness about 0.5 per layer."""
WINDOW = 48
"""`ffn.eplb.window_size`: FFN steps of load in each measurement."""
SETTLE = 8
"""FFN steps between a switch (or the load's start) and a measurement's start."""
ADMIN_KEY = "eplb-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny("qwen3_moe", tmp_path_factory.mktemp("eplb") / "qwen3_moe", skew=SKEW))


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> list[list[int]]:
    """Plain vLLM's greedy ids of each prompt, computed before the app starts."""
    return [tokens[:MAX_TOKENS] for tokens in greedy_reference(checkpoint)]


@pytest.fixture(scope="module")
def http(serve_url: str, checkpoint: str, reference: list[list[int]]) -> Iterator[httpx.Client]:
    # min_gain 0: the rebalance with 2 redundant experts comes after the one without, whose
    # placement already balances most of the skew (mean 0.95-0.96); the replicas then gain
    # less than the default 0.02 on some windows' load, and the layer would stay.
    eplb = {"window_size": WINDOW, "num_redundant_experts": 2, "min_gain": 0}
    ffn = {"num_ranks": 2, "min_ranks": 2, "max_ranks": 3, "eplb": eplb}
    args = app_args(checkpoint, 2, ffn) | {"ingress": {"admin_key_env": "AFD_TEST_EPLB_ADMIN_KEY"}}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AFD_TEST_EPLB_ADMIN_KEY", ADMIN_KEY)
        with deployed(serve_url, args) as client:
            client.timeout = httpx.Timeout(300)
            yield client


class _Load:
    """`STREAMS` threads streaming greedy completions back to back until `stop()`;
    each result is (prompt index, tokens, error)."""

    def __init__(self, http: httpx.Client) -> None:
        self.results: list[tuple[int, list[int], str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(http, i)) for i in range(STREAMS)]
        for thread in self._threads:
            thread.start()

    def _run(self, http: httpx.Client, stream: int) -> None:
        prompt = stream
        while not self._stop.is_set():
            self.results.append(_stream(http, prompt % len(PROMPTS)))
            prompt += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)


def _stream(http: httpx.Client, prompt: int) -> tuple[int, list[int], str | None]:
    body = {
        "model": "tiny",
        "prompt": PROMPTS[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return prompt, tokens, f"{response.status_code}: {response.read().decode()}"
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return prompt, tokens, event["error"]["message"]
            tokens += event["choices"][0].get("token_ids") or []
    return prompt, tokens, None


def _eplb_after(http: httpx.Client, steps: int, within_s: float = 240) -> dict:
    """`/afd/status`'s `eplb` once every serving FFN rank has stepped `steps` steps
    since its start (bounded), with `steps` (the fewest) and `ffn`: each rank's
    `(compute_s, busy_s)` then."""
    deadline = time.monotonic() + within_s
    while True:
        status = http.get("/afd/status").json()
        ffn = [m for m in status["ffn"] if m["state"] != "gone"]
        if status["eplb"] is not None and all(m["steps"] >= steps for m in ffn):
            times = {m["rank"]: (m["compute_s"], m["busy_s"]) for m in ffn}
            return status["eplb"] | {"steps": min(m["steps"] for m in ffn), "ffn": times}
        assert time.monotonic() < deadline, f"the FFN ranks did not reach {steps} steps: {status['ffn']}"
        time.sleep(0.5)


def _window(http: httpx.Client, steps: int) -> dict:
    """`_eplb_after` `steps` FFN steps from now, with `compute_share` (the slowest FFN
    rank's share of the ranks' compute over those steps, `max / sum` of `compute_s`
    growths: 1/2 on two balanced ranks) and `compute_of_step` (its compute over its
    step time, the growth of its `busy_s`). It starts `SETTLE` steps from now: the
    ranks' reports (every 0.2 s) of the steps before a switch are in by then."""
    start = _eplb_after(http, _eplb_after(http, 0)["steps"] + SETTLE)
    end = _eplb_after(http, start["steps"] + steps)
    grown = {
        rank: [b - a for a, b in zip(start["ffn"][rank], times, strict=True)] for rank, times in end["ffn"].items()
    }
    compute, busy = max(grown.values())
    total = sum(c for c, _ in grown.values())
    return end | {"compute_share": compute / total, "compute_of_step": compute / busy}


def _rows_share(eplb: dict) -> float:
    """The slowest EP rank's share of the window's routed rows."""
    return max(eplb["rank_rows"]) / sum(eplb["rank_rows"])


def _check(load: _Load, reference: list[list[int]]) -> None:
    """Every request of `load` ended without error, with plain vLLM's tokens."""
    errors = [(prompt, error) for prompt, _, error in load.results if error is not None]
    assert errors == []
    assert len(load.results) >= STREAMS
    for prompt, tokens, _ in load.results:
        assert tokens == reference[prompt], f"prompt {prompt} ({PROMPTS[prompt]!r})"


def _consistent(http: httpx.Client, ranks: int) -> dict:
    """`/afd/status` once the layout is whole (bounded), asserting that it is
    consistent: `ranks` FFN ranks, all READY and serving the layout's epoch, EP ranks
    0..ranks-1."""
    deadline = time.monotonic() + WHOLE_WITHIN_S
    while not _whole(http):
        assert time.monotonic() < deadline, _status(http)
        time.sleep(0.5)
    status = http.get("/afd/status").json()
    ffn = [m for m in status["ffn"] if m["state"] != "gone"]
    assert sorted(m["ep_rank"] for m in ffn) == list(range(ranks)), ffn
    assert len({m["epoch"] for m in ffn}) == 1 and all(m["state"] == "ready" for m in ffn), ffn
    return status


def test_an_ffn_rank_killed_during_a_rebalance_ends_whole_and_loses_no_request(
    http: httpx.Client, reference: list[list[int]]
) -> None:
    load = _Load(http)
    try:
        before = _eplb_after(http, WINDOW)
        epoch, recoveries = (http.get("/afd/status").json()[key] for key in ("epoch", "recoveries"))
        answer: list[httpx.Response] = []
        post = threading.Thread(target=lambda: answer.append(http.post("/afd/eplb", headers=ADMIN)))
        post.start()
        deadline = time.monotonic() + 60
        while (_status(http) or {"epoch": epoch})["epoch"] == epoch:  # until the rebalance's plan is out
            assert time.monotonic() < deadline and post.is_alive(), answer
            time.sleep(0.02)
        os.kill(_pids("ffn")[-1], signal.SIGKILL)
        killed = time.monotonic()
        post.join(120)
        while not ((now := _status(http)) and len(now["recoveries"]) > len(recoveries)):  # found dead
            assert time.monotonic() - killed < WHOLE_WITHIN_S, now
            time.sleep(0.2)
        status = _consistent(http, 2)
        whole_s = time.monotonic() - killed
        time.sleep(2)  # the streams run on the re-formed layout
    finally:
        load.stop()
    (response,) = answer
    print(f"EPLB + FFN SIGKILL: before {before}\nanswer {response.text}\nwhole again after {whole_s:.1f} s")
    assert response.status_code == 409 and "died" in response.json()["error"], response.text
    assert status["recoveries"][-1]["error"] is None and status["recoveries"][-1]["whole_s"] is not None
    assert status["eplb"]["placements"] == []  # EPLB was not in use: the contiguous blocks
    _check(load, reference)


def test_a_rebalance_under_load_balances_the_ranks_and_keeps_greedy_tokens(
    http: httpx.Client, reference: list[list[int]]
) -> None:
    """Before, between and after two rebalances (no redundant expert, then the
    configured 2), each measured over `WINDOW` FFN steps on the new placement."""
    assert http.post("/afd/eplb").status_code == 401  # admin key
    load = _Load(http)
    try:
        windows, events = [_window(http, WINDOW)], []
        for body in ({"num_redundant_experts": 0}, None):
            response = http.post("/afd/eplb", json=body, headers=ADMIN)
            assert response.status_code == 200, response.text
            events.append(response.json())
            windows.append(_window(http, WINDOW))  # the POST answers once the new layout serves
    finally:
        load.stop()
    before, middle, after = windows
    for name, window in zip(("before", "no redundant", "2 redundant"), windows, strict=True):
        shares = f"rows {_rows_share(window):.3f}, compute {window['compute_share']:.3f}"
        print(f"EPLB {name}: {window}\nslowest FFN rank's share: {shares}, of its step {window['compute_of_step']:.3f}")
    print(f"events {events}")
    for event in events:
        assert event["epoch"] is not None and event["bytes_loaded"] > 0 and event["pause_s"] >= 0, event
        assert event["balancedness_after"] >= event["balancedness_before"], event  # on the window's load
    # measured on the 2-core CI machine, 3 runs (mean balancedness over the 2 layers; the slowest
    # EP rank's share of the routed rows, of the ranks' compute, its compute over its step time):
    # before 0.75-0.77, 0.66-0.68, 0.51-0.68, 0.24-0.30; no redundant 0.95-0.98, 0.51-0.53, 0.53-0.56,
    # 0.20-0.28; 2 redundant 0.94-0.96, 0.52-0.54, 0.50-0.56, 0.22-0.29
    assert sum(before["balancedness"]) / 2 < 0.8 and events[0]["balancedness_before"] < 0.8, before
    assert events[0]["layers_moved"] == 2 and middle["num_redundant_experts"] == 0, middle
    assert all(len(rank) == 4 for slots in middle["placements"] for rank in slots), middle["placements"]
    assert sum(middle["balancedness"]) / 2 > 0.88, middle
    # from the no-replica placement, a layer whose balancedness would fall stays
    moved = [new for new, old in zip(after["placements"], middle["placements"], strict=True) if new != old]
    assert len(moved) == events[1]["layers_moved"] >= 1, (middle["placements"], after["placements"])
    assert all(len(rank) == 5 for slots in moved for rank in slots) and after["num_redundant_experts"] == 2, after
    # a layer's balancedness varies by up to ~0.09 from one 48-step window's load to the next
    assert sum(after["balancedness"]) / 2 > 0.88 and min(after["balancedness"]) > 0.8, after
    rows = [_rows_share(w) for w in windows]
    assert rows[0] > 0.62 and rows[1] < 0.56 and rows[2] < 0.56, rows
    # The compute share stays near 1/2 throughout: each rank's compute of a step is mostly
    # the same fixed work (the rows received, routing, sorting, the grouped GEMMs' fixed
    # costs); the experts' own arithmetic on a few rows of H 128, I 64 is microseconds. So
    # it is measured and shown here, not asserted to fall (that needs expert-bound steps).
    for window in windows:
        assert 0.5 <= window["compute_share"] < 1 and 0 < window["compute_of_step"] <= 1, window
    _check(load, reference)
    status = http.get("/afd/status").json()
    assert status["eplb"]["rebalances"][-1]["epoch"] == events[-1]["epoch"]
    assert all(m["epoch"] == events[-1]["epoch"] for m in status["ffn"] if m["state"] != "gone")
    # the trace of a request shows both EP ranks' compute of each of its steps (`FFNStep.index` joins them)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    done = http.post("/v1/completions", json=body).json()
    time.sleep(1)  # the ranks' step records reach the coordinator with their reports (every 0.2 s)
    steps = http.get(f"/afd/trace/{done['id']}").json()["steps"]
    ranks = sorted(str(m["rank"]) for m in status["ffn"])
    print(
        "FFN compute per rank of each step (ms):",
        [{r: round(1e3 * t, 2) for r, t in s["ffn_rank_compute_s"].items()} for s in steps],
    )
    assert len(steps) >= MAX_TOKENS - 2 and all(sorted(s["ffn_rank_compute_s"]) == ranks for s in steps), steps


def test_a_resize_keeps_the_placement_policy_and_refuses_a_rebalance_meanwhile(
    http: httpx.Client, reference: list[list[int]]
) -> None:
    """2A:2F -> 2A:3F after the rebalances: the 3-rank layout takes the policy's
    placement for 3 ranks (8 experts + 1 redundant: 3 slots a rank; the contiguous
    blocks, 3, 3, 2, would not even split evenly); a rebalance asked for meanwhile
    answers 409 and the resize ends whole."""
    rebalances = len(http.get("/afd/status").json()["eplb"]["rebalances"])
    load = _Load(http)
    try:
        answer: list[httpx.Response] = []
        scale = threading.Thread(
            target=lambda: answer.append(
                http.post("/afd/scale", json={"attention": 2, "ffn": 3}, headers=ADMIN, timeout=600)
            )
        )
        scale.start()
        deadline = time.monotonic() + 60
        while (_status(http) or {}).get("target_ffn") != 3:  # the resize runs
            assert time.monotonic() < deadline, answer
            time.sleep(0.1)
        during = http.post("/afd/eplb", headers=ADMIN)
        scale.join(600)
        status = _consistent(http, 3)
        time.sleep(2)  # the streams run on the new layout
    finally:
        load.stop()
    (resized,) = answer
    print(f"EPLB during a resize: {during.text}\nresize {resized.text}\nafter {status['eplb']}")
    assert during.status_code == 409 and "layout is changing" in during.json()["error"], during.text
    assert resized.status_code == 200 and resized.json()["error"] is None, resized.text
    eplb = status["eplb"]
    assert len(eplb["rebalances"]) == rebalances + 1 and eplb["num_redundant_experts"] == 1, eplb
    assert len(eplb["placements"]) == 2 and all(
        len(slots) == 3 and all(len(rank) == 3 for rank in slots) for slots in eplb["placements"]
    ), eplb["placements"]
    assert min(eplb["balancedness"]) > 0.75, eplb  # on the window's load: mostly steps of the old layout
    _check(load, reference)
