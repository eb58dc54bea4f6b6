"""The GPU decode benchmark's code paths on CPU: gloo pair groups, tiny shapes, no graphs.

Runs every section of `afd_ray.bench.decode` end to end (P2P bulk, connector round
trip, and per model the correctness check and the AFD / colocated 1-GPU / colocated
2-GPU (EP2) steps with DBO off and on) and checks the result file's schema and that
the AFD step matched the colocated one. Timings on this machine mean nothing.
"""

from __future__ import annotations

import json

from afd_ray.bench.decode import main


def test_decode_bench_runs_on_cpu_and_matches_colocated(tmp_path):
    out = tmp_path / "decode.json"
    main(
        [
            "--device", "cpu", "--tiny", "--out", str(out), "--batches", "4", "--context", "16",
            "--iters", "1", "--warmup", "1", "--roundtrip-tokens", "1", "4", "--roundtrip-layers", "2",
            "--hidden-a2f", "64", "--tpot-budget-ms", "1e9",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["sections_failed"] == {}
    assert set(result["roundtrip_us_eager"]) == {"1", "4"}
    assert result["bulk_share_of_p2p"] > 0
    for name in ("deepseek-v2-lite-like", "qwen3-30b-a3b-like"):
        report = result["models"][name]
        assert report["correctness"]["passed"], report["correctness"]
        assert report["correctness"]["checks"]["afd_eager_dbo_off"]["rel_err"] < 1e-5
        assert report["correctness"]["checks"]["afd_eager_dbo_on"]["token_match"] == 1.0
        row = report["batches"]["4"]
        split = row["afd_dbo_on_split_ms"]
        assert {"attention", "ffn", "exposed_comm", "idle_attention_gpu", "idle_ffn_gpu"} <= set(split)
    assert set(result["tokens_per_s_per_gpu"]) == {"afd_1a1f", "colocated_1gpu", "colocated_2gpu"}
    assert 0 <= result["dbo_exposed_comm_frac"] <= 1
