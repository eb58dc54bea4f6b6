"""The AFD Mixtral class against plain vLLM Mixtral, on the embedded `smollm2-moe`.

Plain vLLM (its own fused MoE) and vLLM with `AFDMixtralForCausalLM` generate greedily
in float32 from the upcycled SmolLM2 (4 experts, top-2); the AFD engine's MoE halves
are served by an in-process `FFNRuntime` thread over a real gloo pair channel, running
afd_ray's FFN stack (checked against transformers' Mixtral in
tests/ffn/test_mixtral_upcycled.py). Both engines run in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one after the other.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer

from afd_ray.attention.ffn_client import FFNPeerConfig
from afd_ray.attention.ffn_op import close_ffn_client
from afd_ray.attention.plugin import afd_architecture
from afd_ray.connector.channel import FFNChannel
from afd_ray.control.membership import AttentionAssignment
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.observability.stats import FFNStats
from afd_ray.models.embedded import prepare_smollm2_moe

QUESTION = "What is the capital of France?"
PLAIN_PROMPTS = ("The quick brown fox", "def main():")
NEW_TOKENS = 12
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Runs:
    """Greedy generations of `prompts` by plain vLLM and by vLLM with the AFD class."""

    prompts: list[str]
    """The chat-templated `QUESTION`, then `PLAIN_PROMPTS`."""
    plain: list[list[int]]
    afd: list[list[int]]
    answer: str
    """Plain vLLM's decoded answer to `QUESTION`."""
    plain_params: dict[str, int]
    afd_params: dict[str, int]
    """Each engine's resident parameter bytes by name (`afd_param_bytes`)."""
    ffn_stats: FFNStats


def _generate(prompts: list[str], **engine_args: object) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy ids of `prompts` from one in-process engine and its resident parameter
    bytes by name; the engine is shut down before returning."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(**engine_args, worker_extension_cls="afd_ray.attention.worker.AFDWorkerExtension")
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    (param_bytes,) = llm.collective_rpc("afd_param_bytes")
    del llm, outputs
    gc.collect()
    cleanup_dist_env_and_memory()
    return tokens, param_bytes


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    """Plain vLLM, then AFD vLLM with an in-process FFN runtime, on `smollm2-moe`."""
    folder = prepare_smollm2_moe()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompts = [chat, *PLAIN_PROMPTS]
    threads = torch.get_num_threads()  # the vLLM CPU worker lowers it in-process
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        engine_args = dict(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=256)
        plain, plain_params = _generate(prompts, **engine_args)

        ffn = load_ffn_stack(folder, torch.float32, torch.device("cpu"))
        channel = FFNChannel("127.0.0.1", "gloo", TIMEOUT_S)
        runtime = FFNRuntime(ffn, channel, torch.float32, poll_s=0.05, batch_window_s=0.0)
        loop = threading.Thread(target=runtime.run, name="ffn-mixtral", daemon=True)
        loop.start()
        assignment = AttentionAssignment.to_ffn(channel.address, 0, 0, 0, "gloo", TIMEOUT_S)
        try:
            afd, afd_params = _generate(
                prompts,
                **engine_args,
                hf_overrides={"architectures": [afd_architecture(folder)]},
                additional_config=FFNPeerConfig(assignment=assignment),
            )
        finally:
            close_ffn_client()  # the engine's worker ran in this process
            runtime.stop()
            loop.join(TIMEOUT_S)
        answer = tokenizer.decode(plain[0], skip_special_tokens=True)
        yield Runs(prompts, plain, afd, answer, plain_params, afd_params, runtime.stats)
    torch.set_num_threads(threads)


def test_afd_class_is_registered_for_mixtral() -> None:
    assert afd_architecture(prepare_smollm2_moe()) == "AFDMixtralForCausalLM"


def test_greedy_tokens_equal_plain_vllm_in_float32(runs: Runs) -> None:
    assert "Paris" in runs.answer
    assert all(len(set(tokens)) >= 4 for tokens in runs.plain), runs.plain  # not degenerate
    assert runs.afd == runs.plain
    assert runs.ffn_stats.steps >= NEW_TOKENS  # the FFN runtime served the generation


def test_attention_role_holds_no_moe_weights(runs: Runs) -> None:
    """The AFD engine holds exactly plain vLLM's parameters minus the MoE ones."""
    moe = {n for n in runs.plain_params if ".block_sparse_moe." in n}
    assert moe  # plain vLLM's gate and experts live under `.block_sparse_moe.`
    assert set(runs.afd_params) == set(runs.plain_params) - moe
    for name, size in runs.afd_params.items():
        assert size == runs.plain_params[name], name
