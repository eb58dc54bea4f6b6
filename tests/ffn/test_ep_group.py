"""EP over real gloo all-gathers and reduce-scatters between FFN ranks (threads here),
every rank padded to the same row count.

The oracle is the single-rank FFN stack holding every expert.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.eplb.policy import LayerPlacement, place_layer
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.tiny import build_tiny

CPU = torch.device("cpu")


def _run_ep(
    checkpoint: Path, tokens: list[int], placements: list[LayerPlacement] | None = None
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each EP rank r (a thread with its own store client) sends `tokens[r]` rows through every MoE layer; returns (EP output,
    inputs) per rank and layer."""
    size = len(tokens)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    outputs: list[list[torch.Tensor]] = [[] for _ in range(size)]
    inputs: list[list[torch.Tensor]] = [[] for _ in range(size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            stack = load_ffn_stack(checkpoint, torch.float32, CPU, ep_rank=r, ep_size=size, placements=placements)
            moe = [block for block in stack.layers if isinstance(block, MoE)]
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            group = new_process_group("gloo", dist.PrefixStore("ep", client), r, size, 30)
            ep = EPGroup(group, moe[0].spec.num_experts, CPU)
            # A rank with no tokens of its own (no local step) learns the layer the
            # group's step starts at from the others (it crashed reading steps[0]).
            first = 1 if tokens[r] else 0
            assert ep.agree(tokens[r], first_layer=first) == sum(tokens)
            assert ep.step_tokens == tuple(tokens)
            assert ep.first_layer == 1
            padded = max(tokens) + 2  # any common row count >= every rank's tokens
            generator = torch.Generator().manual_seed(r)
            with torch.inference_mode():
                for block in moe:
                    hidden = torch.randn(padded, stack.hidden_size, generator=generator)
                    inputs[r].append(hidden[: tokens[r]])
                    outputs[r].append(ep.moe(block, hidden, block.route(hidden))[: tokens[r]])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return outputs, inputs


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("tokens", [[5, 3], [7, 0, 4]], ids=["ep2", "ep3-one-rank-empty"])
def test_ep_moe_equals_the_single_rank_moe(tmp_path: Path, family: str, tokens: list[int]) -> None:
    checkpoint = Path(build_tiny(family, tmp_path / family))
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    moe_layers = [i for i, block in enumerate(full.layers) if isinstance(block, MoE)]
    outputs, inputs = _run_ep(checkpoint, tokens)
    with torch.inference_mode():
        for r in range(len(tokens)):
            for got, hidden, layer in zip(outputs[r], inputs[r], moe_layers, strict=True):
                assert got.shape == (tokens[r], full.hidden_size)
                # Each token's routed rows are summed per owning rank first: float32 rounding only.
                torch.testing.assert_close(got, full(layer, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "redundant"), [([6, 5], 2), ([7, 0, 4], 4)], ids=["ep2-r2", "ep3-r4-one-rank-empty"]
)
def test_ep_moe_with_replicated_experts_equals_the_single_rank_moe(
    tmp_path: Path, tokens: list[int], redundant: int
) -> None:
    """EPLB placements, different per layer, with hot experts replicated on two ranks:
    each row of a replicated expert is computed by one replica only (`ExpertSlots`),
    so the summed output is the single-rank MoE's."""
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    moe_layers = [i for i, block in enumerate(full.layers) if isinstance(block, MoE)]
    loads = [[100, 90, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 50, 80]][: len(moe_layers)]
    placements = [place_layer(load, len(tokens), redundant) for load in loads]
    assert all(max(p.replicas()) >= 2 for p in placements)
    outputs, inputs = _run_ep(checkpoint, tokens, placements)
    with torch.inference_mode():
        for r in range(len(tokens)):
            for got, hidden, layer in zip(outputs[r], inputs[r], moe_layers, strict=True):
                torch.testing.assert_close(got, full(layer, hidden), rtol=1e-5, atol=1e-5)


def test_a_step_resumed_at_another_layer_waits_for_its_own_agreement() -> None:
    """EP rank 0 resumes a step at layer 2 (its attention peer lost its FFN rank
    mid-pass) while rank 1 has a fresh step from layer 0: the group runs layer 2 on,
    and rank 1 takes part without rows (its step would have run the wrong layers;
    before, both ranks' rows ran from layer 2). At the next agreement rank 1 steps."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    agreed: dict[int, list[tuple[int, tuple[int, ...], int]]] = {}
    errors: list[BaseException] = []

    def rank(r: int, rounds: list[tuple[int, int]]) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            ep = EPGroup(new_process_group("gloo", dist.PrefixStore("ep", client), r, 2, 30), 8, CPU)
            agreed[r] = [(ep.agree(t, first_layer=f), ep.step_tokens, ep.first_layer) for t, f in rounds]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [
        threading.Thread(target=rank, args=(0, [(5, 2), (0, 0)])),
        threading.Thread(target=rank, args=(1, [(3, 0), (3, 0)])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert agreed[0] == agreed[1] == [(5, (5, 0), 2), (3, (0, 3), 0)]
