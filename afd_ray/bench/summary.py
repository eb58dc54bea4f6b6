"""`python -m afd_ray.bench.summary`: the product-path results file of one GPU run
(`benchmarks/results/<gpu>-<date>-product.json`) from the files its parts wrote.

Inputs, each written on the device by `benchmarks/h200/product.sh` / `micro.sh`:
- `--serve-logs`: logs of `tests/gpu/test_serve_one_gpu.py` (its `SERVE_ONE_GPU {...}`
  lines: one record per family and graph mode);
- `--bench`: `python -m afd_ray.bench` result JSONs (`afd_ray.bench.schema.BenchResult`),
  plain vLLM and AFD 1A:1F of one model shape (DeepSeek-V2-Lite's, the issue's keys),
  one or more runs (a batch measured again in a later file takes that file's numbers);
- `--fan-in`: the same, plain vs 2A:1F vs 2A:1F-dbo (`product.sh fanin`);
- `--other-benches`: the same for other shapes (Qwen3-30B-A3B's), under `other_shapes`;
- `--roundtrip`: `python -m afd_ray.bench.cuda_ipc` JSON (`roundtrip_us_graph`);
- `--moe-layer`: `python -m afd_ray.bench.moe_layer` JSON.

Keys written (issue 13): `gpu`, `vllm_version`, `equal_tokens` (family -> bool: every
mode run was equal: all tokens in float32, >= `BF16_MIN_EQUAL` of positions in
bfloat16), `equal_tokens_by_mode`, `prompt_logprob_max_abs_diff`,
`roundtrip_us_graph` ("1"/"16"/"128" -> µs), `moe_layer_over_floor` (DeepSeek-V2-Lite
shape at T = 128), `afd_over_plain_tok_s` (best AFD batch over best plain batch, output
tok/s) and `product` (batch -> tok/s and TPOT per side), plus `graphs` (whether the
bench ran CUDA graphs) and `step_split` (batch -> the AFD 1A:1F run's FFN step split:
`timed_steps`, `step_ms`, `attention_ms`, `wire_ms`, `ffn_ms`, `idle_ms` and the four
`*_fraction`s, `afd_ray.bench.schema.StepSplitResult`; left out when the bench timed
no step), `other_shapes` (shape -> the same keys from `--other-benches`), and `fan_in`
(batch -> per layout output tok/s, TPOT and FFN step split, and `dbo_over_no_dbo`: the
2A:1F-dbo layout's tok/s over 2A:1F's, DBO on over off). A missing input leaves its
keys out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from afd_ray.bench.schema import BenchResult

__all__ = ["BF16_MIN_EQUAL", "equality", "fan_in", "main", "product", "summarize"]

BF16_MIN_EQUAL = 0.95
"""Share of equal greedy positions that counts as equal in bfloat16 (the GPU test's bound)."""
_RECORD = "SERVE_ONE_GPU "
_MOE_SHAPE, _MOE_TOKENS = "deepseek_v2_lite", "128"


def equality(logs: list[Path]) -> dict[str, object]:
    """`equal_tokens`, `equal_tokens_by_mode` and `prompt_logprob_max_abs_diff` from the
    `SERVE_ONE_GPU` records of the GPU test's logs (a later record of the same family
    and mode replaces an earlier one).

    Modes are the test's: `eager`, `graphs` (piecewise), `full` (whole-step decode
    graphs), with `-2A1F-dbo` appended for its 2A:1F case; records written before the
    test named its mode count as `eager` or `graphs`. Each mode's entry names the `log`
    it came from (its file name carries the run's date)."""
    records: dict[tuple[str, str], tuple[dict[str, object], str]] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(_RECORD):
                record = json.loads(line[len(_RECORD) :])
                mode = record.get("mode") or ("eager" if record["eager"] else "graphs")
                mode += "-2A1F-dbo" if record.get("dbo") else ""
                records[(record["family"], mode)] = (record, log.name)
    by_mode: dict[str, dict[str, dict[str, object]]] = {}
    for (family, mode), (record, log) in sorted(records.items()):
        share = record["equal_positions"] / record["positions"]
        equal = record["all_equal"] if record["dtype"] == "float32" else share >= BF16_MIN_EQUAL
        by_mode.setdefault(family, {})[mode] = {
            "equal": equal,
            "equal_positions": record["equal_positions"],
            "positions": record["positions"],
            "prompt_logprob_max_abs_diff": record["prompt_logprob_max_abs_diff"],
            "dtype": record["dtype"],
            "log": log,
        }
    return {
        "equal_tokens": {family: all(m["equal"] for m in modes.values()) for family, modes in by_mode.items()},
        "equal_tokens_by_mode": by_mode,
        "prompt_logprob_max_abs_diff": {
            family: {mode: m["prompt_logprob_max_abs_diff"] for mode, m in modes.items()}
            for family, modes in by_mode.items()
        },
    }


_ByBatchAndLabel = dict[str, dict[str, dict[str, float]]]
"""batch (concurrency, as a string) -> run label -> named values."""


def _sides(results: list[BenchResult], labels: tuple[str, ...]) -> tuple[_ByBatchAndLabel, _ByBatchAndLabel]:
    """Per batch (concurrency) and label in `labels`: output tok/s and TPOT p50, and the
    AFD runs' FFN step split (rounded to 4 digits); later results replace earlier ones."""
    table: _ByBatchAndLabel = {}
    split: _ByBatchAndLabel = {}
    for result in results:
        for run in result.runs:
            if run.label not in labels:
                continue
            batch = str(run.concurrency)
            table.setdefault(batch, {})[run.label] = {
                "output_tok_s": round(run.output_tokens_per_s, 1),
                "tpot_p50_ms": round(run.tpot.p50_ms, 2),
            }
            if run.ffn and run.ffn[0].split is not None:
                split.setdefault(batch, {})[run.label] = {
                    k: round(v, 4) for k, v in run.ffn[0].split.model_dump().items()
                }
    return table, split


def product(results: list[BenchResult]) -> dict[str, object]:
    """Per batch (concurrency) and side (`plain`, `1A1F`): output tok/s and TPOT p50;
    `afd_over_plain_tok_s`: the best AFD 1A:1F batch's tok/s over the best plain batch's;
    `step_split`: per batch, the 1A:1F run's FFN step split (rounded to 4 digits).

    Raises:
        ValueError: the results have no plain or no 1A:1F run.
    """
    table, split = _sides(results, ("plain", "1A1F"))
    best: dict[str, float] = {}
    for sides in table.values():
        for label, side in sides.items():
            best[label] = max(best.get(label, 0.0), side["output_tok_s"])
    if set(best) != {"plain", "1A1F"}:
        raise ValueError(f"--bench: needs plain and 1A1F runs, has {sorted(best)}")
    step_split = {batch: by_label["1A1F"] for batch, by_label in split.items()}
    return {
        "families": sorted({run.family for result in results for run in result.runs}),
        "graphs": all(not result.config.enforce_eager for result in results),
        "product": table,
        "afd_over_plain_tok_s": round(best["1A1F"] / best["plain"], 3),
    } | ({"step_split": step_split} if step_split else {})


def fan_in(result: BenchResult) -> dict[str, dict[str, object]]:
    """Per batch: output tok/s and TPOT p50 of `plain`, `2A1F` and `2A1F-dbo`, the two
    AFD layouts' FFN step split, and `dbo_over_no_dbo` (2A1F-dbo tok/s over 2A1F's).

    Raises:
        ValueError: a batch lacks the 2A1F or the 2A1F-dbo run.
    """
    table, split = _sides([result], ("plain", "2A1F", "2A1F-dbo"))
    out: dict[str, dict[str, object]] = {}
    for batch, sides in table.items():
        if not {"2A1F", "2A1F-dbo"} <= set(sides):
            raise ValueError(f"--fan-in: batch {batch} needs 2A1F and 2A1F-dbo runs, has {sorted(sides)}")
        ratio = sides["2A1F-dbo"]["output_tok_s"] / sides["2A1F"]["output_tok_s"]
        out[batch] = sides | {"step_split": split.get(batch, {}), "dbo_over_no_dbo": round(ratio, 3)}
    return out


def summarize(
    serve_logs: list[Path],
    benches: list[Path],
    roundtrip: Path | None,
    moe_layer: Path | None,
    other_benches: list[Path] | None = None,
    fan_in_bench: Path | None = None,
) -> dict[str, object]:
    """The results object of one GPU run (module docstring); inputs left None or empty
    are skipped.

    Raises:
        ValueError: the benches have no plain or no 1A:1F run, an other bench holds
            more than one shape, or the fan-in bench lacks a layout.
    """
    out: dict[str, object] = {}
    results = [BenchResult.model_validate_json(path.read_text()) for path in benches]
    if results:
        last = results[-1]
        out |= {"gpu": last.machine.gpu, "vllm_version": last.machine.vllm, "date": last.created}
    if serve_logs:
        out |= equality(serve_logs)
    if roundtrip is not None:
        out["roundtrip_us_graph"] = json.loads(roundtrip.read_text())["roundtrip_us_graph"]
    if moe_layer is not None:
        layer = json.loads(moe_layer.read_text())
        out["moe_layer_over_floor"] = layer[_MOE_SHAPE]["tokens"][_MOE_TOKENS]["fused_over_floor"]
        out.setdefault("gpu", layer["gpu"])
        out.setdefault("vllm_version", layer["vllm_version"])
    if results:
        out |= product(results)
    if fan_in_bench is not None:
        out["fan_in"] = fan_in(BenchResult.model_validate_json(fan_in_bench.read_text()))
    others: dict[str, dict[str, object]] = {}
    for path in other_benches or []:
        shape = product([BenchResult.model_validate_json(path.read_text())])
        families = shape["families"]
        if len(families) != 1:
            raise ValueError(f"--other-benches: {path} holds shapes {families}; give one file per shape")
        others[families[0]] = shape
    return out | ({"other_shapes": others} if others else {})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m afd_ray.bench.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-logs", type=Path, nargs="*", default=[], help="tests/gpu/test_serve_one_gpu.py logs")
    parser.add_argument(
        "--bench", type=Path, nargs="*", default=[], help="python -m afd_ray.bench result JSONs (plain and 1A1F)"
    )
    parser.add_argument("--fan-in", type=Path, help="python -m afd_ray.bench result JSON (plain, 2A1F, 2A1F-dbo)")
    parser.add_argument("--roundtrip", type=Path, help="python -m afd_ray.bench.cuda_ipc JSON")
    parser.add_argument("--moe-layer", type=Path, help="python -m afd_ray.bench.moe_layer JSON")
    parser.add_argument("--other-benches", type=Path, nargs="*", default=[], help="bench JSONs of other shapes")
    parser.add_argument("--out", type=Path, required=True, help="the results file to write")
    args = parser.parse_args(argv)
    summary = summarize(args.serve_logs, args.bench, args.roundtrip, args.moe_layer, args.other_benches, args.fan_in)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("equal_tokens", "afd_over_plain_tok_s") if k in summary}))


if __name__ == "__main__":
    main()
