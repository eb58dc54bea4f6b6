"""The FFN compute on CUDA: bfloat16 EP over NCCL and CUDA graphs.

Oracle: the float32 CPU FFN stack of the same random weights (`moe_case`), routing
taken from it and sent in (gate_on_attention), so bfloat16 routing flips cannot
decide the result. Each rank's output of each layer must be within
`REL_TOLERANCE` of the reference in ||out - ref||_F / ||ref||_F, and the CUDA graph
replay must equal the eager run on the same padded buffers bit for bit, for captured
buckets (exact and padded sizes) and for sizes beyond the largest bucket (eager
fallback).

Runs as a script too: `python3 tests/gpu/test_ffn_cuda.py` (repo root on PYTHONPATH).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_case import BUCKETS, REL_TOLERANCE, run_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]


def _check_records(records: dict, reference_routing: bool) -> None:
    """Graph == eager everywhere; the error bound where the routing is the reference's."""
    layers = records["layers"]
    assert {r["bucket"] for r in layers} >= {None, *[b for b in BUCKETS if b in {r["rows"] for r in layers}]}
    for record in layers:
        assert record["graph_equals_eager"], record
        if reference_routing or record["ids_match_ref"] in (None, True):
            assert record["rel_err"] <= REL_TOLERANCE, record


def _print(results: dict) -> None:
    for key in ("gate_on_attention", "gate_on_ffn"):
        if key in results:
            layers = results[key]["layers"]
            worst = max(layers, key=lambda r: r["rel_err"] if r["ids_match_ref"] in (None, True) else 0)
            print(
                f"rank {results['rank']}/{results['world']} {key}: capture {results[key]['capture_s']:.2f} s, "
                f"worst rel err {worst['rel_err']:.2e} (step {worst['counts']}, layer {worst['decoder_layer']}), "
                f"graph==eager {all(r['graph_equals_eager'] for r in layers)}, "
                f"timing us {results[key]['moe_layer_timing']}"
            )
    print(json.dumps(results))


def test_one_gpu_matches_float32_reference(reference_case: Path, tmp_path: Path) -> None:
    """One GPU, no EP: the gate_on_attention stack against the reference, and the
    gate_on_ffn stack (its own bfloat16 routing and the dense layer inside the graphs)
    graph against eager; its MoE error is bounded only where its routing equals the
    reference's."""
    run_rank(0, 1, 0, str(reference_case), str(tmp_path))
    results = json.loads((tmp_path / "rank0.json").read_text())
    _print(results)
    _check_records(results["gate_on_attention"], reference_routing=True)
    _check_records(results["gate_on_ffn"], reference_routing=False)
    assert any(r["ids_match_ref"] for r in results["gate_on_ffn"]["layers"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_over_nccl_matches_float32_reference(reference_case: Path, tmp_path: Path) -> None:
    """Two processes, one GPU each, EP=2 over NCCL: each owns 32 of the 64 experts."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    mp.spawn(run_rank, args=(2, store.port, str(reference_case), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        _print(results)
        _check_records(results["gate_on_attention"], reference_routing=True)
        assert all(r["rows"] == max(r["counts"]) for r in results["gate_on_attention"]["layers"])


if __name__ == "__main__":
    here = Path(__file__).parent
    sys.exit(pytest.main([str(here), f"--confcutdir={here}", "-q", "-rs", "-s", *sys.argv[1:]]))
