"""`attention.engine_args` served: the guarded app (tests/serve/conftest.py) runs with
`ENGINE_ARGS`; its attention engine's vLLM config holds them and its greedy tokens
equal plain vLLM's with the same arguments."""

from __future__ import annotations

import httpx
import pytest
from guarded_app import ENGINE_ARGS, KV_CACHE_GIB, NAME, USER
from ray import serve
from vllm import SamplingParams

from plain_engine import plain_llm

PROMPTS = ["The quick brown fox", "def main():", "The quick brown fox jumps over"]
"""The third extends the first: with prefix caching it reuses the first's KV blocks."""
MAX_TOKENS = 16


def _tokens(guarded: httpx.Client, prompt: str) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = guarded.post("/v1/completions", json=body, headers=USER)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.timeout(600)
def test_engine_args_reach_vllm_and_tokens_equal_plain_vllm_with_them(guarded: httpx.Client) -> None:
    config = serve.get_deployment_handle("attention", app_name=NAME).vllm_config.remote().result()
    assert config.cache_config.enable_prefix_caching is True
    assert config.scheduler_config.max_num_batched_tokens == ENGINE_ARGS["max_num_batched_tokens"]
    assert config.model_config.seed == ENGINE_ARGS["seed"]
    served = [_tokens(guarded, prompt) for prompt in PROMPTS + PROMPTS[:1]]
    assert served[3] == served[0]  # the first prompt again, its blocks cached

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    checkpoint, length = config.model_config.model, config.model_config.max_model_len
    with plain_llm(checkpoint, length, int(KV_CACHE_GIB * (1 << 30)), **ENGINE_ARGS) as llm:
        plain = [list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids) for prompt in PROMPTS]
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 512
    assert served[:3] == plain
