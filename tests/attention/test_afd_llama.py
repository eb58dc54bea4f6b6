"""The AFD Llama split against plain vLLM, weight ownership by role, and the
transport `auto` picks on one node.

Both go through the session's application (`client` fixture: SmolLM2-135M-Instruct,
float32, 1A:1F; `connector.transport: auto`, so `shm` on the one Ray node) and
compare with vLLM without AFD on the same checkpoint. The gloo transport is served
end to end by `tests/e2e/test_two_nodes.py` (pools on two Ray nodes), and the
config override of `auto` is checked in `tests/connector/test_link.py`.
"""

from __future__ import annotations

import httpx
import pytest
from ray import serve
from vllm import SamplingParams

from afd_ray.config import ModelConfig
from afd_ray.models.embedded import resolve_checkpoint
from plain_engine import plain_llm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plain_tokens(args: dict[str, object]) -> list[list[int]]:
    """Greedy ids of vLLM without AFD for each of `PROMPTS` (one at a time) on the
    application's checkpoint, float32, eager. The engine runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no EngineCore child to start, which re-imported
    vLLM beside the session's application) and is shut down before the tests."""
    model = ModelConfig.model_validate(args["model"])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with plain_llm(str(resolve_checkpoint(model)), model.max_model_len, 1 << 30) as llm:
        outputs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in PROMPTS]
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
    return tokens


def _afd_token_ids(client: httpx.Client, prompt: str, route: str = "") -> list[int]:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = client.post(f"{route}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_greedy_tokens_equal_plain_vllm_in_float32(client: httpx.Client, plain_tokens: list[list[int]]) -> None:
    for prompt, expected in zip(PROMPTS, plain_tokens, strict=True):
        assert len(expected) == MAX_TOKENS or expected[-1] in (0, 1, 2)
        assert _afd_token_ids(client, prompt) == expected, prompt


def test_each_role_holds_only_its_own_weights(client: httpx.Client) -> None:
    attention = serve.get_deployment_handle("attention", app_name="afd").param_bytes.remote().result()
    ffn = serve.get_deployment_handle("ffn", app_name="afd").param_bytes.remote().result()
    print("attention-role parameter bytes:", attention)
    print("FFN-role parameter bytes:", ffn)

    assert not [name for name in attention if ".mlp." in name]
    assert sum(attention.values()) > 0
    assert set(ffn) == {"layers.gate_proj.weight", "layers.up_proj.weight", "layers.down_proj.weight"}
    # SmolLM2-135M: 30 layers x 3 x (576 x 1536) float32 weights
    assert sum(ffn.values()) == 30 * 3 * 576 * 1536 * 4


def _pair_transports(app: str) -> dict[int, str]:
    return serve.get_deployment_handle("ffn", app_name=app).peer_transports.remote().result()


def test_the_session_pair_runs_over_shm_on_one_node(client: httpx.Client) -> None:
    _afd_token_ids(client, PROMPTS[0])
    assert _pair_transports("afd") == {0: "shm"}
