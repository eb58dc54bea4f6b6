"""FFN compute through `FFNGraphs` on CPU (eager: CUDA graphs need a GPU, see
tests/gpu): bucket choice, padded buffers, and outputs equal to the stack's own."""

from __future__ import annotations

import pytest
import torch

from afd_ray.ffn.graphs import BucketGraphs, FFNGraphs, bucket_of, ffn_layer
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE

CPU = torch.device("cpu")


def test_bucket_of_picks_the_smallest_bucket_that_holds_the_rows() -> None:
    buckets = (1, 2, 4, 8)
    assert [bucket_of(buckets, rows) for rows in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert bucket_of((), 1) is None


@pytest.mark.parametrize("buckets", [(0, 1), (2, 2), (4, 2)])
def test_bad_buckets_are_rejected(buckets: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketGraphs(lambda rows: None, buckets)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_buckets_without_cuda_are_rejected() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        BucketGraphs(lambda rows: None, (1, 2))


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_eager_layers_equal_the_stack(checkpoint, gate_on_attention: bool) -> None:
    stack = load_ffn_stack(checkpoint("deepseek_v3"), torch.float32, CPU, gate_on_attention=gate_on_attention)
    reference = load_ffn_stack(checkpoint("deepseek_v3"), torch.float32, CPU)
    graphs = FFNGraphs(stack, None, torch.float32, buckets=())
    inputs = graphs.inputs(5)
    assert inputs.bucket is None and inputs.hidden.shape == (5, stack.hidden_size)
    assert (inputs.routing is not None) == gate_on_attention
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i, layer in enumerate(stack.layer_ids):
            inputs.hidden.copy_(torch.randn(inputs.hidden.shape, generator=generator))
            block = reference.layers[layer]
            routing = block.route(inputs.hidden) if isinstance(block, MoE) else None
            if inputs.routing is not None:
                inputs.routing.ids.copy_(routing.ids)
                inputs.routing.weights.copy_(routing.weights)
            out, ids = graphs.run(i, inputs)
            assert torch.equal(out, ffn_layer(reference, None, layer, inputs.hidden, routing).out)
            assert torch.equal(out, reference(layer, inputs.hidden))
            assert (ids is None) == (routing is None)
            if ids is not None:
                assert torch.equal(ids, routing.ids)
