"""The FFN boundary ops under vLLM's piecewise graph split (what CUDA graphs on the
attention side rely on), on CPU with a real FFN runtime over `shm`.

vLLM splits the Dynamo graph at its splitting ops (`vllm.compilation.backends.split_graph`,
the function its compile backend calls) and replays each non-splitting piece as a CUDA
graph that reads the addresses it saw at capture. A piece may therefore read only
tensors that a piece (or the graph's inputs) produced, never one a splitting op
allocated eagerly. The test splits a layer stack that calls `remote_ffn` / `remote_moe`
with the AFD splitting ops, checks that every FFN op's output buffer comes from the
piece before it and that nothing downstream reads a value the op's own piece returns,
then runs the split module (pieces eager, as vLLM does before capture) against the
FFN stack called directly. Before the out-variant ops, the op returned a fresh tensor
that the next piece read: the second check fails on that form (seen on an H200 as
0 of 96 tokens equal under piecewise graphs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import fx
from vllm.compilation.backends import split_graph
from vllm.compilation.partition_rules import should_split

from afd_ray.attention.ffn_op import SPLITTING_OPS, begin_ffn_step, remote_ffn, remote_moe
from afd_ray.compat import splitting_ops_with
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.models.tiny import build_tiny
from ffn_peer import ffn_peer

TOKENS = 6


def _runtime(family: str, tmp_path: Path, gate_on_attention: bool = False) -> Iterator[FFNStack]:
    """The FFN stack of a tiny `family` model, served by a real FFN runtime over `shm`
    whose client this process's ops use."""
    checkpoint = build_tiny(family, tmp_path / family)
    stack = load_ffn_stack(Path(checkpoint), torch.float32, torch.device("cpu"), gate_on_attention=gate_on_attention)
    with ffn_peer(stack, torch.float32, timeout_s=10):
        yield stack


@pytest.fixture
def llama(tmp_path: Path) -> Iterator[FFNStack]:
    yield from _runtime("llama", tmp_path)


@pytest.fixture
def moe(tmp_path: Path) -> Iterator[FFNStack]:
    """`gate_on_attention`: the served stack holds the experts, not the routers."""
    yield from _runtime("qwen3_moe", tmp_path, gate_on_attention=True)


def _split(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, fx.GraphModule]:
    """Compile `fn` with a backend that splits its Dynamo graph as vLLM's piecewise
    backend does (AFD splitting ops included) and runs the pieces eagerly; returns
    `fn(*inputs)` so computed and the split module."""
    split: list[fx.GraphModule] = []

    def backend(graph: fx.GraphModule, example_inputs: list[torch.Tensor]) -> fx.GraphModule:
        split_gm, _ = split_graph(graph, splitting_ops_with(SPLITTING_OPS))
        split.append(split_gm)
        return split_gm

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    (split_gm,) = split
    return out, split_gm


def _check_pieces(split_gm: fx.GraphModule, ops: int) -> None:
    """`ops` pieces hold an FFN op; each reads its output buffer from an earlier
    piece and returns nothing that a later piece reads."""
    seen = 0
    for piece in (n for n in split_gm.graph.nodes if n.op == "call_module"):
        module = getattr(split_gm, piece.target)
        calls = [m for m in module.graph.nodes if should_split(m, list(SPLITTING_OPS))]
        if not calls:
            continue
        seen += 1
        (op,) = calls
        assert not piece.users, f"{piece.target}: a later piece reads a tensor the FFN op's piece returned"
        placeholders = [m for m in module.graph.nodes if m.op == "placeholder"]
        buffer = piece.args[placeholders.index(op.args[-2])]  # the op's `out`
        source = buffer.args[0] if buffer.op == "call_function" else buffer  # getitem of a piece's outputs
        assert source.op == "call_module" and source.target != piece.target, f"{piece.target}: out from {source}"
    assert seen == ops


def test_remote_ffn_splits_with_its_buffer_in_the_previous_piece(llama: FFNStack) -> None:
    hidden = torch.randn(TOKENS, llama.hidden_size, generator=torch.Generator().manual_seed(0))

    def layers(x: torch.Tensor) -> torch.Tensor:
        for layer in range(llama.num_layers):
            x = remote_ffn(torch.tanh(x), layer) + x  # a piece before and after each op
        return x * 0.5

    with torch.inference_mode():
        begin_ffn_step(TOKENS)
        got, split_gm = _split(layers, hidden)
        expected = hidden
        for layer in range(llama.num_layers):
            expected = llama(layer, torch.tanh(expected)) + expected
    torch.testing.assert_close(got, expected * 0.5, rtol=1e-5, atol=1e-5)
    _check_pieces(split_gm, llama.num_layers)


def test_remote_moe_splits_with_its_buffer_in_the_previous_piece(moe: FFNStack, tmp_path: Path) -> None:
    """`gate_on_attention`: each layer's router runs in the piece before the op."""
    full = load_ffn_stack(tmp_path / "qwen3_moe", torch.float32, torch.device("cpu"))
    blocks = [full.layers[full.layer_ids.index(layer)] for layer in moe.layer_ids]
    hidden = torch.randn(TOKENS, moe.hidden_size, generator=torch.Generator().manual_seed(0))

    def layers(x: torch.Tensor) -> torch.Tensor:
        for layer, block in zip(moe.layer_ids, blocks, strict=True):
            routing = block.route(x)  # ids [T, k] int64, weights [T, k] float32
            x = remote_moe(x, routing.ids, routing.weights, layer) + x
        return x

    with torch.inference_mode():
        begin_ffn_step(TOKENS)
        got, split_gm = _split(layers, hidden)
        expected = hidden
        for block in blocks:
            expected = block(expected, block.route(expected)) + expected
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _check_pieces(split_gm, len(moe.layer_ids))
