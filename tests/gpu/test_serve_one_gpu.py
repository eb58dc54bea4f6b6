"""AFD 1A:1F on ONE GPU through the real Serve application, against plain vLLM on the
same GPU: the attention engine (vLLM, `AttentionServer`) and the FFN rank
(`FFNServer`) share the GPU through 0.5-GPU bundles and exchange activations over
`cuda_ipc` (NCCL refuses two ranks on one device).

- tiny Llama and tiny Qwen3-MoE in float32 (vLLM picks a float32-capable attention
  backend for both engines): greedy tokens equal;
- tiny DeepSeek-V3 (MLA) in bfloat16, built with DeepSeek's MLA head sizes
  (`build_tiny(..., cuda_mla_heads=True)`: vLLM's CUDA MLA prefill needs them):
  greedy tokens equal for >= 95% of positions; the prompt logprobs' max abs
  difference is printed and recorded for every family.

Each family in three modes (`afd_ray.attention.engine.afd_compilation_config`):
- `graphs` (`attention.cudagraph_mode: piecewise`): vLLM's piecewise graphs split at
  the FFN boundary ops; the reference is plain vLLM in the same mode (`cudagraph_mode:
  PIECEWISE`). Plain vLLM's default mode (FULL_AND_PIECEWISE) is run too and its
  agreement with plain PIECEWISE recorded (`plain_full_vs_piecewise_equal`): how far
  graph modes alone move bf16 tokens.
- `full` (`attention.cudagraph_mode: full_decode`): decode steps replay whole-step
  graphs, exchanges captured; the reference is plain vLLM in FULL_AND_PIECEWISE, and
  the attention rank must have replayed graphs (`graph_replays` > 0).
- `eager`: both engines eager.
Needs CUDA, vLLM and Ray (the device pack); run with the NVIDIA MPS daemon up for
speed (it is correct without). Skips visibly elsewhere. `-k graphs`, `-k full` or
`-k eager` picks a mode.
Prints one JSON line per family (`SERVE_ONE_GPU {...}`) for the results file.
"""

from __future__ import annotations

import gc
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

PROMPTS = ["The quick brown fox", "def main():", "Hello, my name is", "import os", "class Node:", "In the beginning"]
LENGTHS = [4, 24, 9, 16, 31, 12]
FAMILIES = {"llama": "float32", "qwen3_moe": "float32", "deepseek_v3": "bfloat16"}
MODES = ("graphs", "full", "eager")
CASES = [(family, mode, False) for mode in MODES for family in FAMILIES] + [("qwen3_moe", "graphs", True)]
"""(family, mode, dbo): CUDA-graph cases first; `dbo`: 2A:1F on the GPU (1/3-GPU
bundles), the FFN rank serving its two attention peers in two ubatches per layer
(`ffn.ubatches`), instead of 1A:1F."""
PLAIN_MODE = {"graphs": "PIECEWISE", "full": "FULL_AND_PIECEWISE", "eager": None}
"""The plain vLLM reference of each mode (vLLM `cudagraph_mode`; None: eager)."""
BF16_MIN_EQUAL = 0.95


def _plain(
    checkpoint: Path, dtype: str, mode: str | None, quantization: str | None = None
) -> tuple[list[list[int]], list[list[float]]]:
    """Plain vLLM's greedy tokens and prompt logprobs, in-process, then the GPU freed;
    `mode`: vLLM's `cudagraph_mode` (None: eager); `quantization`: vLLM's (`fp8`: dynamic FP8)."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    graphs = {} if mode is None else {"compilation_config": {"cudagraph_mode": mode}}
    try:
        llm = LLM(
            str(checkpoint),
            dtype=dtype,
            enforce_eager=mode is None,
            max_model_len=512,
            max_num_seqs=8,
            kv_cache_memory_bytes=1 << 28,
            gpu_memory_utilization=0.3,
            quantization=quantization,
            **graphs,
        )
        tokens, logprobs = [], []
        for prompt, length in zip(PROMPTS, LENGTHS, strict=True):
            params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True, prompt_logprobs=0)
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            tokens.append(list(out.outputs[0].token_ids))
            logprobs.append(
                [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
            )
        llm.llm_engine.engine_core.shutdown()
        del llm
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs


@pytest.fixture(scope="module")
def serve_url() -> str:
    ray = pytest.importorskip("ray", reason="needs Ray (the device pack)")
    from ray import serve

    from tests.ports import free_port  # run from the repo root, without the suite's conftest

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_gpus=1, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.mark.parametrize(
    ("family", "mode", "dbo"), CASES, ids=[f"{f}-{m}{'-2A1F-dbo' if d else ''}" for f, m, d in CASES]
)
def test_afd_on_one_gpu_equals_plain_vllm(serve_url: str, family: str, mode: str, dbo: bool, tmp_path: Path) -> None:
    _served_equals_plain(serve_url, family, FAMILIES[family], mode, dbo, tmp_path)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 kernels need compute capability >= 8.9",
)
def test_fp8_afd_on_one_gpu_equals_plain_vllm_fp8(serve_url: str, tmp_path: Path) -> None:
    """Issue 35: tiny Qwen3-MoE in bfloat16 with `model.quantization: fp8` (the
    attention engine's linears in vLLM's dynamic FP8, the FFN rank's routed experts in
    FP8 through vLLM's fused-MoE kernels), piecewise graphs, against plain vLLM with
    `quantization="fp8"` in PIECEWISE: greedy tokens equal for >= 95% of positions."""
    _served_equals_plain(serve_url, "qwen3_moe", "bfloat16", "graphs", False, tmp_path, quantization="fp8")


def _served_equals_plain(
    serve_url: str, family: str, dtype: str, mode: str, dbo: bool, tmp_path: Path, quantization: str | None = None
) -> None:
    import httpx
    from ray import serve

    from afd_ray.models.tiny import build_tiny
    from afd_ray.serve.app import build_app

    checkpoint = Path(build_tiny(family, tmp_path / family, cuda_mla_heads=family.startswith("deepseek")))
    eager = mode == "eager"
    expected, expected_logprobs = _plain(checkpoint, dtype, PLAIN_MODE[mode], quantization)
    full = _plain(checkpoint, dtype, "FULL_AND_PIECEWISE", quantization)[0] if mode == "graphs" else None
    args = {
        "platform": "cuda",
        "model": {
            "source": str(checkpoint),
            "served_name": "tiny",
            "dtype": dtype,
            "max_model_len": 512,
            "quantization": quantization,
        },
        "attention": {
            "num_ranks": 2 if dbo else 1,
            "kv_cache_gib": 0.25,
            "max_num_seqs": 8,
            "bundle_resources": 0.33 if dbo else 0.5,
            "gpu_memory_utilization": 0.2 if dbo else 0.3,
            "enforce_eager": eager,
            "cudagraph_mode": "full_decode" if mode == "full" else "piecewise",
        },
        "ffn": {"bundle_resources": 0.33 if dbo else 0.5, "ubatches": 2 if dbo else 1},
        "connector": {"transport": "cuda_ipc", "batch_window_us": 3000},
    }
    name = f"gpu-{family}-{mode}{'-dbo' if dbo else ''}{'-fp8' if quantization else ''}"
    start = time.perf_counter()
    try:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        started_s = time.perf_counter() - start
        attention = serve.get_deployment_handle("attention", app_name=name)
        graphs = attention.graphs_captured.remote().result()
        with httpx.Client(base_url=serve_url, timeout=300) as http:

            def complete(i: int) -> tuple[list[int], list[float]]:
                body = {
                    "model": "tiny",
                    "prompt": PROMPTS[i],
                    "max_tokens": LENGTHS[i],
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "prompt_logprobs": 0,
                }
                response = http.post(f"/{name}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                # prompt_logprobs=0: each position holds the prompt token's entry only
                entries = (choice.get("prompt_logprobs") or [None])[1:]
                return choice["token_ids"], [next(iter(entry.values()))["logprob"] for entry in entries if entry]

            # 2A:1F-dbo: concurrent requests, so both attention ranks step at once
            with ThreadPoolExecutor(len(PROMPTS) if dbo else 1) as pool:
                got, got_logprobs = (list(part) for part in zip(*pool.map(complete, range(len(PROMPTS)))))
        replays = attention.graph_replays.remote().result()
    finally:
        serve.delete(name)
    positions = sum(len(t) for t in expected)
    equal = sum(a == b for got_t, exp_t in zip(got, expected, strict=True) for a, b in zip(got_t, exp_t, strict=True))
    diffs = [
        abs(a - b)
        for g, e in zip(got_logprobs, expected_logprobs, strict=True)
        if len(g) == len(e)
        for a, b in zip(g, e, strict=True)
    ]
    record = {
        "family": family,
        "eager": eager,
        "mode": mode,
        "graph_replays": replays,
        "dbo": dbo,
        "dtype": dtype,
        "quantization": quantization,
        "equal_positions": equal,
        "positions": positions,
        "all_equal": got == expected,
        "prompt_logprob_max_abs_diff": max(diffs) if diffs else None,
        "app_start_s": started_s,
        "graphs_captured": graphs,
        "gpu": torch.cuda.get_device_name(0),
        "plain_full_vs_piecewise_equal": None
        if full is None
        else sum(
            a == b for full_t, exp_t in zip(full, expected, strict=True) for a, b in zip(full_t, exp_t, strict=True)
        ),
    }
    print("SERVE_ONE_GPU " + json.dumps(record), flush=True)
    assert (graphs > 0) != eager, record  # graph cases really captured; eager ones did not
    assert (replays > 0) == (mode == "full"), record  # only full mode replays whole steps
    if dtype == "float32":
        assert got == expected
    else:
        assert equal / positions >= BF16_MIN_EQUAL, record
