"""`attention.cudagraph_mode: full_decode`, the host side, on CPU (a CPU cannot capture
CUDA graphs; `tests/gpu/test_serve_one_gpu.py` runs the mode on a GPU against plain vLLM).

- The engine settings: vLLM's FULL_AND_PIECEWISE graphs split at the FFN ops; the V2
  model runner (the one with the `ModelState` hook) on CUDA only, since vLLM's CPU
  build refuses it without Triton.
- Every AFD class hands vLLM's V2 runner the model state that announces replays.
- A replayed step, as a real FFN runtime over `shm` sees it: the STEP header from the
  runner's hook (`announce_replay`, the graph's padded T), then only the data-plane
  exchanges the captured graph holds, with no `begin_ffn_step` and no per-layer call
  of `FFNClient`: the FFN answers every layer, and the step's record keeps its header,
  `exchange_s` 0 and `replayed`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from afd_ray.attention.engine import afd_compilation_config, engine_env
from afd_ray.attention.ffn_client import take_steps
from afd_ray.attention.ffn_op import SPLITTING_OPS, announce_replay, begin_ffn_step, ffn_client
from afd_ray.attention.model_state import AFDModelState
from afd_ray.attention.plugin import AFD_ARCHITECTURES
from afd_ray.config import AttentionPoolConfig
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.models.tiny import build_tiny
from ffn_peer import ffn_peer

PADDED = 8
"""A graph size vLLM pads a decode batch to (here: 5 requests in the graph of 8)."""


def test_full_decode_captures_whole_decode_steps_split_at_the_ffn_ops() -> None:
    full = afd_compilation_config(AttentionPoolConfig(enforce_eager=False))  # the default mode
    piecewise = afd_compilation_config(AttentionPoolConfig(enforce_eager=False, cudagraph_mode="piecewise"))
    assert (str(full.cudagraph_mode), str(piecewise.cudagraph_mode)) == ("FULL_AND_PIECEWISE", "PIECEWISE")
    assert set(SPLITTING_OPS) <= set(full.splitting_ops) and full.splitting_ops == piecewise.splitting_ops


def test_the_v2_runner_is_asked_for_only_where_graphs_are_captured() -> None:
    """On this CPU build vLLM refuses the V2 runner ("Model Runner V2 requires Triton")."""
    for attention in (
        AttentionPoolConfig(enforce_eager=False, cudagraph_mode="full_decode"),
        AttentionPoolConfig(cudagraph_mode="full_decode"),
        AttentionPoolConfig(enforce_eager=False, cudagraph_mode="piecewise"),
    ):
        assert "VLLM_USE_V2_MODEL_RUNNER" not in engine_env(attention), attention


@pytest.mark.parametrize("arch", sorted(AFD_ARCHITECTURES))
def test_every_afd_class_supplies_the_replay_announcing_model_state(arch: str) -> None:
    """vLLM's V2 runner takes a model's own state from `get_model_state_cls()`
    (`vllm.v1.worker.gpu.model_states`)."""
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls

    module, name = AFD_ARCHITECTURES[arch].split(":")
    cls = getattr(importlib.import_module(module), name)
    assert resolve_model_state_cls(None, cls) is AFDModelState
    assert issubclass(AFDModelState, DefaultModelState)


@pytest.fixture
def llama(tmp_path: Path) -> Iterator[FFNStack]:
    checkpoint = build_tiny("llama", tmp_path / "llama")
    stack = load_ffn_stack(Path(checkpoint), torch.float32, torch.device("cpu"))
    with ffn_peer(stack, torch.float32, timeout_s=10):
        yield stack


def test_a_replay_is_announced_once_and_served_from_data_plane_calls_alone(llama: FFNStack) -> None:
    take_steps()  # records of earlier tests in this process (the ring records by default)
    generator = torch.Generator().manual_seed(0)
    hidden = [torch.randn(PADDED, llama.hidden_size, generator=generator) for _ in range(llama.num_layers)]
    client = ffn_client()
    for _ in range(2):  # two replays of one captured graph
        announce_replay(PADDED)
        for layer in range(llama.num_layers):
            out = torch.empty_like(hidden[layer])
            client.link.exchange(hidden[layer], out=out)  # what the graph replays per layer
            torch.testing.assert_close(out, llama(layer, hidden[layer]), rtol=1e-5, atol=1e-5)
    begin_ffn_step(PADDED)  # an eager step after them: closes the second replay's record
    for layer in range(llama.num_layers):
        client.exchange(hidden[layer], layer)
    assert client.replays == 2
    first, second = take_steps()
    assert (first.num_tokens, second.num_tokens, first.exchange_s, second.exchange_s) == (PADDED, PADDED, 0.0, 0.0)
    assert first.replayed and second.replayed
    assert second.step_id == first.step_id + 1
