"""NVLink pair transport (`afd_ray.connector.nvlink`): the slot layout on CPU; the
transport itself on two CUDA GPUs (skipped visibly without them).

On a GPU machine without Ray: `PYTHONPATH=. python3 -m pytest tests/connector/test_nvlink.py
--confcutdir=tests/connector -rs`.
"""

from __future__ import annotations

import json

import pytest
import torch

from afd_ray.connector.nvlink import AttentionNVLink, FFNNVLink, SlotLayout


def test_layout_regions_are_disjoint_and_fill_the_buffer():
    layout = SlotLayout(max_tokens=16, hidden_size=8, ubatches=2)
    assert layout.region_numel == 128
    starts = sorted(offset for u in range(2) for offset in (layout.a2f_offset(u), layout.f2a_offset(u)))
    assert starts == [0, 128, 256, 384]
    assert layout.numel == starts[-1] + layout.region_numel


def test_layout_channels_are_distinct_and_leave_the_barrier_channel():
    layout = SlotLayout(max_tokens=4, hidden_size=8, ubatches=2)
    channels = [c for u in range(2) for c in (layout.a2f_channel(u), layout.f2a_channel(u))]
    assert sorted(channels) == [1, 2, 3, 4]
    assert layout.channels == 5


def test_layout_rejects_bad_sizes_slots_and_token_counts():
    with pytest.raises(ValueError, match="max_tokens"):
        SlotLayout(max_tokens=0, hidden_size=8)
    with pytest.raises(ValueError, match="ubatches"):
        SlotLayout(max_tokens=4, hidden_size=8, ubatches=0)
    layout = SlotLayout(max_tokens=4, hidden_size=8)
    with pytest.raises(ValueError, match="ubatch 1"):
        layout.a2f_offset(1)
    layout.check_tokens(4)
    for tokens in (0, 5):
        with pytest.raises(ValueError, match="num_tokens"):
            layout.check_tokens(tokens)


@pytest.mark.parametrize("side", [AttentionNVLink, FFNNVLink])
def test_a_side_needs_a_cuda_device(side):
    layout = SlotLayout(max_tokens=4, hidden_size=8)
    with pytest.raises(ValueError, match="CUDA device"):
        side("0", layout, torch.bfloat16, torch.device("cpu"), 1000)


def test_a_side_refuses_another_symmetric_memory_backend(monkeypatch):
    monkeypatch.setenv("TORCH_SYMMMEM", "NVSHMEM")
    layout = SlotLayout(max_tokens=4, hidden_size=8)
    with pytest.raises(ValueError, match="TORCH_SYMMMEM=NVSHMEM"):
        AttentionNVLink("0", layout, torch.bfloat16, torch.device("cuda", 0), 1000)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_round_trip_is_exact_eager_and_in_graphs(tmp_path):
    from afd_ray.bench.decode_nvlink import main

    out = tmp_path / "nvlink.json"
    main(["--out", str(out), "--tokens", "1", "16", "--layers", "4", "--iters", "3", "--warmup", "1"])
    result = json.loads(out.read_text())
    assert result["failed"] == {}
    assert result["correct"], result["correctness"]
    assert set(result["roundtrip_us_graph_nvlink"]) == {"1", "16"}
