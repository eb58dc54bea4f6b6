"""The AFD MoE classes (Qwen3-MoE, DeepSeek-V2, DeepSeek-V3) against plain vLLM.

Per tiny family (float32, CPU, eager): plain vLLM and vLLM with the AFD class generate
greedily from the same checkpoint; the AFD engine's FFN halves are served by an
in-process `FFNRuntime` thread over a real gloo pair channel. Both engines run
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one after the other.

The FFN oracle is transformers' own model: `model.layers[i].mlp` of the checkpoint
(dense MLP, or the MoE block with its gate, routed and shared experts), so these
tests check the attention-role classes alone, independently of `afd_ray.ffn`. The
DeepSeek checkpoints have a dense first layer (`first_k_dense_replace=1`), which goes
through `remote_ffn` like the MoE ones.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from afd_ray.attention.ffn_client import FFNPeerConfig
from afd_ray.attention.ffn_op import close_ffn_client
from afd_ray.attention.plugin import afd_architecture
from afd_ray.compat import attention_backend
from afd_ray.connector.channel import FFNChannel
from afd_ray.control.membership import AttentionAssignment
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.observability.stats import FFNStats
from afd_ray.models import Family
from afd_ray.models.tiny import build_tiny

FAMILIES: tuple[Family, ...] = ("qwen3_moe", "deepseek_v2", "deepseek_v3")
PROMPTS = ("The quick brown fox", "def main():", "Hello, my name is", "import os")
NEW_TOKENS = 16
TIMEOUT_S = 60.0


class _Block(nn.Module):
    """One transformers MLP/MoE block as a `[T, H] -> [T, H]` map (it takes `[B, S, H]`)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block(hidden.unsqueeze(0))[0]


class TransformersFFN(nn.Module):
    """The FFN stack `FFNRuntime` drives (`layers[i]`, `num_layers`, `hidden_size`,
    `moe_blocks`, `moe_index`, `forward(layer, hidden)`), made of transformers' own per-layer blocks."""

    gate_on_attention = False  # the FFN routes (gate_on_ffn)

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.hidden_size: int = model.config.hidden_size
        self.layers = nn.ModuleList(_Block(layer.mlp) for layer in model.model.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_blocks(self) -> list[nn.Module]:
        """None of afd_ray's `MoE` blocks (transformers' own): the runtime counts no expert load."""
        return []

    @property
    def moe_index(self) -> tuple[None, ...]:
        """Each layer's index among afd_ray's MoE layers: None, none is one."""
        return (None,) * len(self.layers)

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN of decoder layer `layer`: hidden `[T, H]` -> `[T, H]`."""
        return self.layers[layer](hidden)


@dataclass(frozen=True)
class FamilyRun:
    """Greedy generations of `PROMPTS` by plain vLLM and by vLLM with the AFD class."""

    family: Family
    plain: list[list[int]]
    afd: list[list[int]]
    plain_params: dict[str, int]
    afd_params: dict[str, int]
    """Each engine's resident parameter bytes by name (`afd_param_bytes`)."""
    ffn_stats: FFNStats
    """What the FFN runtime served for the AFD engine."""


def _generate(**engine_args: object) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy ids of `PROMPTS` from one in-process engine, and its resident parameter
    bytes by name; the engine is shut down before returning (the next engine in this
    process must not share its distributed state)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(**engine_args, worker_extension_cls="afd_ray.attention.worker.AFDWorkerExtension")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    (param_bytes,) = llm.collective_rpc("afd_param_bytes")
    del llm, outputs
    gc.collect()
    cleanup_dist_env_and_memory()
    return tokens, param_bytes


@pytest.fixture(scope="module", params=FAMILIES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyRun]:
    """Plain vLLM, then AFD vLLM with an in-process FFN runtime, on one tiny family."""
    family: Family = request.param
    folder = build_tiny(family, tmp_path_factory.mktemp("tiny") / family)
    threads = torch.get_num_threads()  # the vLLM CPU worker lowers it in-process
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        engine_args = dict(
            model=str(folder),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            attention_backend=attention_backend(folder, "float32"),
        )
        plain, plain_params = _generate(**engine_args)

        ffn = TransformersFFN(folder)
        channel = FFNChannel("127.0.0.1", "gloo", TIMEOUT_S)
        runtime = FFNRuntime(ffn, channel, torch.float32, poll_s=0.05, batch_window_s=0.0)
        loop = threading.Thread(target=runtime.run, name=f"ffn-{family}", daemon=True)
        loop.start()
        assignment = AttentionAssignment.to_ffn(channel.address, 0, 0, 0, "gloo", TIMEOUT_S)
        try:
            afd, afd_params = _generate(
                **engine_args,
                hf_overrides={"architectures": [afd_architecture(folder)]},
                additional_config=FFNPeerConfig(assignment=assignment),
            )
        finally:
            close_ffn_client()  # the engine's worker ran in this process
            runtime.stop()
            loop.join(TIMEOUT_S)
        yield FamilyRun(family, plain, afd, plain_params, afd_params, runtime.stats)
    torch.set_num_threads(threads)


def test_greedy_tokens_equal_plain_vllm_in_float32(run: FamilyRun) -> None:
    assert all(len(set(tokens)) >= 4 for tokens in run.plain), run.plain  # not degenerate
    assert run.afd == run.plain
    assert run.ffn_stats.steps >= NEW_TOKENS  # the FFN runtime served the generation


def test_attention_role_holds_no_ffn_weights(run: FamilyRun) -> None:
    """The AFD engine holds exactly plain vLLM's parameters minus the MLP/MoE ones."""
    ffn = {n for n in run.plain_params if ".mlp." in n}
    assert ffn  # plain vLLM's gate and experts live under `.mlp.`
    assert set(run.afd_params) == set(run.plain_params) - ffn
    for name, size in run.afd_params.items():
        assert size == run.plain_params[name], name
