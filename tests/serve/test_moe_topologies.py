"""MoE under AFD through the real application: M:N mapping and EP across FFN ranks.

Tiny random Qwen3-MoE and DeepSeek-V3 checkpoints (float32) are served with A
attention ranks and F FFN ranks (EP=F); greedy tokens must equal plain vLLM's on the
same checkpoint, for 2A:1F, 1A:2F and 3A:2F (`MATRIX`; the other layouts are served
by `tests/e2e/test_resize.py`). 3A:2F covers fan-in (an FFN rank with two attention peers), a
non-integer ratio and EP2; 1A:2F covers A < F (an FFN rank with no attention peer
still takes part in every step's all-to-alls); `gate_on_attention` runs routing and
the dense layers on the attention ranks.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from ray import serve

from afd_ray.compat import attention_backend
from afd_ray.models.tiny import build_tiny
from afd_ray.serve.app import build_app

PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Hello, my name is",
    "import os",
    "class Node:",
    "In the beginning",
]
LAYERS = {"qwen3_moe": 2, "deepseek_v3": 3}
LENGTHS = [4, 24, 9, 16, 31, 12]  # completion tokens per prompt: steps of different lengths


def _plain_vllm_tokens(checkpoint: Path) -> list[list[int]]:
    """Greedy tokens of plain vLLM (no AFD), one prompt at a time, in-process engine."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(
            str(checkpoint),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            kv_cache_memory_bytes=1 << 28,
            attention_backend=attention_backend(checkpoint, "float32"),
        )
        tokens = []
        for prompt, length in zip(PROMPTS, LENGTHS):
            params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            tokens.append(list(out.outputs[0].token_ids))
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    return tokens


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """One family's tiny checkpoint and plain vLLM's greedy tokens for `PROMPTS`.

    Parametrized indirectly by family, so each family has its own fixture instance:
    a family whose reference fails to build errors only its own tests."""
    family = request.param
    checkpoint = Path(build_tiny(family, tmp_path_factory.mktemp(family) / family))
    return checkpoint, _plain_vllm_tokens(checkpoint)


@pytest.fixture(scope="module")
def http(serve_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve_url, timeout=300) as client:
        yield client


def _args(checkpoint: Path, attention: int, ffn: int, gate: str, ubatches: int) -> dict[str, object]:
    return {
        "gate_placement": gate,
        "model": {"source": str(checkpoint), "served_name": "tiny", "max_model_len": 512},
        "attention": {"num_ranks": attention, "kv_cache_gib": 0.25, "max_num_seqs": 8, "bundle_resources": 0.5},
        "ffn": {"num_ranks": ffn, "bundle_resources": 0.5, "ubatches": ubatches},
    }


# Each case deploys its own app (A engines start on 2 CPU cores), so the full family x
# topology x gate product (20 cases, ~24 min) is not run. `tests/e2e/test_resize.py` serves the
# tiny Qwen3-MoE (gate_on_ffn) at 1A:1F, 2A:1F, 2A:2F and 1A:2F against plain vLLM's
# tokens; the cases below add DeepSeek-V3 (MLA, a dense layer 0) under both gate
# placements, fan-in (2A:1F, 3A:2F), A < F (1A:2F), a non-integer ratio and EP2 with
# the gate on the attention ranks. The 2A:1F case serves its two attention peers in two
# ubatches per layer (`ffn.ubatches`, DBO across attention ranks).
MATRIX = [
    ("deepseek_v3", 2, 1, "gate_on_ffn", 2),
    ("deepseek_v3", 1, 2, "gate_on_attention", 1),
    ("qwen3_moe", 3, 2, "gate_on_attention", 1),
]


@pytest.mark.parametrize(
    ("reference", "attention", "ffn", "gate", "ubatches"),
    MATRIX,
    ids=[f"{f}-{a}A{n}F-{g}" + (f"-{u}ubatches" if u > 1 else "") for f, a, n, g, u in MATRIX],
    indirect=["reference"],
)
def test_greedy_tokens_equal_plain_vllm_across_topologies(
    http: httpx.Client,
    reference: tuple[Path, list[list[int]]],
    request: pytest.FixtureRequest,
    attention: int,
    ffn: int,
    gate: str,
    ubatches: int,
) -> None:
    checkpoint, expected = reference
    family = request.node.callspec.params["reference"]
    name = f"{family}-{attention}a{ffn}f-{gate.replace('_', '-')}"
    serve.run(build_app(_args(checkpoint, attention, ffn, gate, ubatches)), name=name, route_prefix=f"/{name}")
    try:
        status = http.get(f"/{name}/afd/status").json()
        peers = sorted(member["ffn_peer"] for member in status["attention"])
        assert peers == sorted(rank % ffn for rank in range(attention))  # balanced mapping

        def complete(i: int) -> list[int]:
            body = {
                "model": "tiny",
                "prompt": PROMPTS[i],
                "max_tokens": LENGTHS[i],
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            response = http.post(f"/{name}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        # Concurrent requests of different lengths: steps batch several requests and,
        # with 3 attention ranks, several attention peers per FFN rank.
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, range(len(PROMPTS))))
        for i, (tokens, reference) in enumerate(zip(got, expected)):
            assert tokens == reference, f"prompt {i} ({PROMPTS[i]!r}) under {attention}A:{ffn}F"
        time.sleep(0.5)  # FFN ranks push counters every 0.2 s
        status = http.get(f"/{name}/afd/status").json()
        assert all(member["steps"] > 0 for member in status["ffn"])  # both EP ranks stepped
        for member in status["ffn"]:  # expert load: top-2 experts in each of 2 MoE layers
            assert len(member["expert_tokens"]) == 8
            assert sum(member["expert_tokens"]) == member["tokens"] * 2 * 2
            # gate_on_attention: only the 2 MoE layers cross (DeepSeek's dense layer 0 stays)
            moe_only = gate == "gate_on_attention" and family == "deepseek_v3"
            assert member["layers"] == member["steps"] * (2 if moe_only else LAYERS[family])
    finally:
        # Not waited for: the next case deploys while this one's replicas stop (the
        # ingress alone stays 5 s, RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S).
        serve.delete(name, _blocking=False)
