"""The shipped MoE demo, `deployments/afd-moe.yaml`: the upcycled SmolLM2 (`smollm2-moe`,
Mixtral, 4 experts, top-2) on 2 attention ranks and 2 FFN ranks with EP2.

The application is built from the file's `args` on the session's Serve instance at
`/moe`. Its experts are copies of SmolLM2's MLPs with top-2 weights summing to 1, so
the answer is SmolLM2's only if dispatch and combine across the two EP ranks return
every token's rows to their place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from afd_ray.models.embedded import SMOLLM2_MOE_EXPERTS, prepare_smollm2_moe
from afd_ray.serve.app import build_app

YAML = Path(__file__).parents[2] / "deployments" / "afd-moe.yaml"
NAME = "afd-moe"
PREFIX = "/moe"
QUESTION = "What is the capital of France?"
NUM_LAYERS = 30  # SmolLM2-135M; every layer of the upcycled model is an MoE
TOP_K = 2


@pytest.fixture(scope="module")
def args() -> dict[str, object]:
    """The `args` of the only application in `deployments/afd-moe.yaml`."""
    (application,) = yaml.safe_load(YAML.read_text())["applications"]
    return application["args"]


@pytest.fixture(scope="module")
def moe(serve_url: str, args: dict[str, object]) -> Iterator[httpx.Client]:
    """An HTTP client of the MoE application, deployed for this module at `PREFIX`."""
    prepare_smollm2_moe()  # once here, not raced by the four replicas
    serve.run(build_app(args), name=NAME, route_prefix=PREFIX)
    try:
        with httpx.Client(base_url=serve_url + PREFIX, timeout=300) as http:
            yield http
    finally:
        serve.delete(NAME, _blocking=False)  # the next module need not wait out its replicas' stop


def _settled_status(http: httpx.Client, advanced_from: dict[int, int]) -> dict:
    """`/afd/status` once every FFN rank reported more steps than `advanced_from[rank]`
    and two reports in a row agree (the counters are pushed every 0.2 s)."""
    deadline = time.monotonic() + 30
    previous = None
    while time.monotonic() < deadline:
        status = http.get("/afd/status").json()
        status.pop("metrics")  # a snapshot taken at each call: its time always differs
        status.pop("admission")  # the ingress's admission state, likewise per call
        if status == previous and all(m["steps"] > advanced_from[m["rank"]] for m in status["ffn"]):
            return status
        previous = status
        time.sleep(0.3)
    raise AssertionError(f"FFN counters did not advance from {advanced_from}: {previous}")


def test_shipped_yaml_is_the_2a_2f_moe_demo(args: dict[str, object]) -> None:
    assert args["model"]["source"] == "smollm2-moe" and args["model"]["dtype"] == "float32"
    assert args["attention"]["num_ranks"] == 2 and args["ffn"]["num_ranks"] == 2
    # Fits the 2 CPUs `serve run` gives a local cluster on a 2-core machine.
    bundles = [args[pool]["num_ranks"] * args[pool]["bundle_resources"] for pool in ("attention", "ffn")]
    assert sum(bundles) <= 2


def test_chat_answers_paris_across_both_ep_ranks(moe: httpx.Client) -> None:
    status = moe.get("/afd/status").json()
    assert sorted(m["rank"] for m in status["attention"]) == [0, 1]
    assert sorted(m["ffn_peer"] for m in status["attention"]) == [0, 1]
    assert sorted(m["rank"] for m in status["ffn"]) == [0, 1]
    before = {m["rank"]: m for m in status["ffn"]}

    def chat(_: int) -> str:
        body = {
            "model": "smollm2-moe",
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 16,
        }
        response = moe.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(2) as pool:  # two at once: Serve may give each attention rank one
        answers = list(pool.map(chat, range(2)))
    assert all("Paris" in answer for answer in answers), answers

    after = _settled_status(moe, {rank: m["steps"] for rank, m in before.items()})
    tokens = {m["rank"]: m["tokens"] - before[m["rank"]]["tokens"] for m in after["ffn"]}
    assert sum(tokens.values()) > 0
    routed = [0] * SMOLLM2_MOE_EXPERTS
    for m in after["ffn"]:
        load = [n - b for n, b in zip(m["expert_tokens"], before[m["rank"]]["expert_tokens"], strict=True)]
        assert sum(load) == tokens[m["rank"]] * NUM_LAYERS * TOP_K  # every token, every layer, k experts
        routed = [r + n for r, n in zip(routed, load, strict=True)]
    assert min(routed) > 0, routed  # rows reached every expert, so both EP ranks' halves
