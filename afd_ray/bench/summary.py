"""`python -m afd_ray.bench.summary`: the results file of one GPU run
(`benchmarks/results/<gpu>-<date>-product.json`) from the files its parts wrote.

Every input comes from the same run, made from one commit (`--commit`, else `git
rev-parse HEAD` of this checkout): a bench result or an equality record that names
another commit is refused, and equality comes only from the logs given (product.sh
passes its OUT folder's), never from earlier runs.

Inputs, each written on the device by `benchmarks/h200/product.sh` / `micro.sh`:
- `--bench`: `python -m afd_ray.bench` result JSONs (`afd_ray.bench.schema.BenchResult`,
  schema 3) with plain vLLM and AFD 1A:1F runs of one or more model shapes; several
  files (one shape or batch per device call) pool their repeats;
- `--fan-in`: the same with plain and other AFD layouts (2A:1F, 2A:1F-dbo);
- `--serve-logs`: logs of `tests/gpu/test_serve_one_gpu.py` (its `SERVE_ONE_GPU {...}`
  lines: one record per family and mode);
- `--roundtrip`: `python -m afd_ray.bench.cuda_ipc` JSON (`roundtrip_us_graph`);
- `--moe-layer`: `python -m afd_ray.bench.moe_layer` JSON;
- `--ffn-vs-vllm`, `--plan-check`, `--plan-predictions`: JSON holding the key of that
  name (or being its value), copied in after a type check (`_COPIED`).

Keys written (issue 32), shapes named as `afd_ray.models.shapes.SHAPES`:
- `commit`, `gpu`, `vllm_version`, `date` (the last bench's end), `graphs` (every
  bench ran CUDA graphs);
- `same_batch`: shape -> batch -> AFD 1A:1F against plain at that batch
  (`same_batch_entry`: `tok_s_ratio`, `decode_tok_s_ratio`, `tpot_p50_ratio`,
  `tpot_p90_ratio`, `ttft_p50_ratio`, each the median over the repeats of AFD/plain of
  one repeat's pair; `repeats`; `spread`: ratio -> [min, max]; `plain`, `afd`: figure ->
  median, min, max), from `afd_ray.bench.compare`;
- `step_split`: shape -> batch -> the 1A:1F FFN rank's step split (medians over the
  repeats: `step_ms`, `attention_ms`, `wire_ms`, `ffn_ms`, `idle_ms`, `idle_fraction`,
  `wire_us_per_layer` = `wire_ms` x 1000 / decoder layers); `idle_fraction` and
  `wire_us_per_layer`: shape -> batch -> that value;
- `fan_in`: shape -> layout -> batch -> the same as `same_batch`, plus `step_split`;
- `equal_tokens_run`: family -> mode -> `{equal, equal_positions, positions, dtype,
  prompt_logprob_max_abs_diff, logs}`;
- `roundtrip_us_graph` (T -> µs); `moe_layer_over_floor`: shape -> T -> the fused MoE
  layer's time over its weight-read floor; `ffn_moe_over_vllm_moe` (shape -> T ->
  float), `plan_check` (layout -> `{predicted_tpot_ms, measured_tpot_ms, rel_err}`),
  `plan_predictions` (layout -> `{gpus, tok_s_per_gpu, tpot_ms, plain_tok_s_per_gpu}`);
- `fp8` (issue 35): the same keys of the runs with `model.quantization: fp8` on both
  sides: `same_batch` and `step_split` of the benches whose config has `quantization:
  fp8` (left out of the top-level `same_batch`), `moe_layer_over_floor` of
  `--fp8-moe-layer`, and `equal_tokens_run` of the FP8 equality records (their modes
  end in `-fp8`; they stay in the top-level `equal_tokens_run` too).

A missing input leaves its keys out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, TypeAdapter

from afd_ray.bench.commit import git_commit
from afd_ray.bench.compare import compare
from afd_ray.bench.schema import BenchResult, SameBatch, Stat

__all__ = ["BF16_MIN_EQUAL", "PRODUCT_LAYOUT", "equality", "main", "same_batch_entry", "step_split", "summarize"]

BF16_MIN_EQUAL = 0.95
"""Share of equal greedy positions that counts as equal in bfloat16 (the GPU test's bound)."""
PRODUCT_LAYOUT = "1A1F"
"""The AFD layout of `same_batch`: one attention rank and one FFN rank on one GPU."""
_RECORD = "SERVE_ONE_GPU "
_FP8_MODE = "-fp8"
"""Suffix of an equality mode whose record ran `model.quantization: fp8` on both sides."""
_DIGITS = 4
_RATIOS = {
    "tok_s_ratio": "output_tok_s",
    "decode_tok_s_ratio": "decode_tok_s",
    "tpot_p50_ratio": "tpot_p50_ms",
    "tpot_p90_ratio": "tpot_p90_ms",
    "ttft_p50_ratio": "ttft_p50_ms",
}
"""Key of each AFD/plain ratio in `same_batch` -> the `Figures` field it is of."""


class _PlanCheck(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    predicted_tpot_ms: float
    measured_tpot_ms: float
    rel_err: float


class _PlanPrediction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    gpus: int
    tok_s_per_gpu: float
    tpot_ms: float
    plain_tok_s_per_gpu: float


_COPIED: dict[str, TypeAdapter] = {
    "ffn_moe_over_vllm_moe": TypeAdapter(dict[str, dict[str, float]]),
    "plan_check": TypeAdapter(dict[str, _PlanCheck]),
    "plan_predictions": TypeAdapter(dict[str, _PlanPrediction]),
}
"""Keys copied from `--ffn-vs-vllm`, `--plan-check`, `--plan-predictions`, and their types."""


def _round(value: float) -> float:
    return round(value, _DIGITS)


def _stat(stat: Stat) -> dict[str, float]:
    return {"median": _round(stat.median), "min": _round(stat.min), "max": _round(stat.max)}


def same_batch_entry(c: SameBatch) -> dict[str, object]:
    """One batch of `same_batch` (module docstring), values rounded to 4 decimals."""
    ratios = {key: getattr(c.ratio, name) for key, name in _RATIOS.items()}
    return (
        {key: _round(stat.median) for key, stat in ratios.items()}
        | {"repeats": c.repeats, "spread": {key: [_round(s.min), _round(s.max)] for key, s in ratios.items()}}
        | {side: {name: _stat(s) for name, s in getattr(c, side)} for side in ("plain", "afd")}
    )


def step_split(results: Sequence[BenchResult], layout: str) -> dict[str, dict[str, dict[str, float]]]:
    """Shape -> batch -> the step split of `layout`'s first FFN rank, medians over the
    runs that timed a step (module docstring); runs without a split are left out.

    Raises:
        ValueError: a run with a split does not record its decoder layers (schema 2).
    """
    splits: dict[tuple[str, str], list[dict[str, float]]] = {}
    for result in results:
        for run in result.runs:
            if run.label != layout or not run.ffn or run.ffn[0].split is None:
                continue
            if run.layers is None:
                raise ValueError(f"runs[]: {run.family} {run.label} records no decoder layers (schema 2); rerun")
            s = run.ffn[0].split
            splits.setdefault((run.family, str(run.concurrency)), []).append(
                {
                    "step_ms": s.step_ms,
                    "attention_ms": s.attention_ms,
                    "wire_ms": s.wire_ms,
                    "ffn_ms": s.ffn_ms,
                    "idle_ms": s.idle_ms,
                    "idle_fraction": s.idle_fraction,
                    "wire_us_per_layer": s.wire_ms * 1e3 / run.layers,
                }
            )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (family, batch), values in sorted(splits.items(), key=lambda item: (item[0][0], int(item[0][1]))):
        out.setdefault(family, {})[batch] = {k: _round(statistics.median(v[k] for v in values)) for k in values[0]}
    return out


def equality(logs: Sequence[Path], commit: str) -> dict[str, dict[str, dict[str, object]]]:
    """`equal_tokens_run` from the `SERVE_ONE_GPU` records of this run's logs: family ->
    mode -> entry. Modes are the test's (`eager`, `graphs`: piecewise, `full`: whole-step
    decode graphs; a record written before the test named its mode counts as `eager` or
    `graphs`), with `-2A1F-dbo` appended for its 2A:1F case. A record is equal when
    all its tokens are (float32) or at least `BF16_MIN_EQUAL` of its positions
    (bfloat16); a family and mode recorded more than once (two parts ran it) sums the
    positions, and is equal only if every record is.

    Raises:
        ValueError: a record names a commit other than `commit`.
    """
    out: dict[str, dict[str, dict[str, object]]] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith(_RECORD):
                continue
            record = json.loads(line[len(_RECORD) :])
            if record.get("commit", commit) != commit:
                raise ValueError(f"--serve-logs: {log} has a record of commit {record['commit']}, not {commit}")
            mode = record.get("mode") or ("eager" if record["eager"] else "graphs")  # older records: no mode
            mode += "-2A1F-dbo" if record.get("dbo") else ""
            mode += _FP8_MODE if record.get("quantization") == "fp8" else ""
            share = record["equal_positions"] / record["positions"]
            equal = record["all_equal"] if record["dtype"] == "float32" else share >= BF16_MIN_EQUAL
            entry = out.setdefault(record["family"], {}).setdefault(
                mode,
                {"equal": True, "equal_positions": 0, "positions": 0, "dtype": record["dtype"]}
                | {"prompt_logprob_max_abs_diff": 0.0, "logs": []},
            )
            entry["equal"] = entry["equal"] and equal
            entry["equal_positions"] += record["equal_positions"]
            entry["positions"] += record["positions"]
            entry["prompt_logprob_max_abs_diff"] = max(
                entry["prompt_logprob_max_abs_diff"], record["prompt_logprob_max_abs_diff"]
            )
            entry["logs"] = sorted({*entry["logs"], log.name})
    return {family: dict(sorted(modes.items())) for family, modes in sorted(out.items())}


def _benches(paths: Sequence[Path], commit: str, flag: str) -> list[BenchResult]:
    """The bench results at `paths`.

    Raises:
        ValueError: a result records another commit, or none.
    """
    results = []
    for path in paths:
        result = BenchResult.model_validate_json(path.read_text())
        if result.commit != commit:
            raise ValueError(f"{flag}: {path} was run from commit {result.commit}, not {commit}")
        results.append(result)
    return results


def _copied(path: Path, key: str) -> object:
    """The value of `key` in the JSON at `path` (or the whole JSON, if it lacks the
    key), checked against `_COPIED[key]` and dumped back to JSON types."""
    data = json.loads(path.read_text())
    value = data[key] if isinstance(data, dict) and key in data else data
    adapter = _COPIED[key]
    return adapter.dump_python(adapter.validate_python(value), mode="json")


def _same_batch(results: Sequence[BenchResult]) -> dict[str, dict[str, object]]:
    """`same_batch` (module docstring) of `results`.

    Raises:
        ValueError: no plain and `PRODUCT_LAYOUT` pair of one batch and repeat.
    """
    same: dict[str, dict[str, object]] = {}
    for c in compare(*(result.runs for result in results)):
        if c.layout == PRODUCT_LAYOUT:
            same.setdefault(c.family, {})[str(c.batch)] = same_batch_entry(c)
    if not same:
        raise ValueError(f"--bench: needs plain and {PRODUCT_LAYOUT} runs of the same batches and repeats")
    return same


def _over_floor(layer: dict[str, object]) -> dict[str, dict[str, float]]:
    """`moe_layer_over_floor` of a `python -m afd_ray.bench.moe_layer` JSON: shape -> T ->
    the fused layer's time over its weight-read floor."""
    shapes = {key: value for key, value in layer.items() if isinstance(value, dict) and "tokens" in value}
    return {
        name.replace("_", "-"): {t: _round(r["fused_over_floor"]) for t, r in shape["tokens"].items()}
        for name, shape in shapes.items()
    }


def summarize(
    commit: str,
    benches: Sequence[Path] = (),
    fan_in: Sequence[Path] = (),
    serve_logs: Sequence[Path] = (),
    roundtrip: Path | None = None,
    moe_layer: Path | None = None,
    copied: dict[str, Path] | None = None,
    fp8_moe_layer: Path | None = None,
) -> dict[str, object]:
    """The results object of one GPU run made from `commit` (module docstring);
    `copied` maps keys of `_COPIED` to their files. Empty inputs are skipped.

    Raises:
        ValueError: an input names another commit; the benches hold no plain and 1A:1F
            pair, or runs of several GPUs; a 1A:1F run lacks its plain pair, or a run
            its decode rate (`afd_ray.bench.compare.compare`); a copied file has the
            wrong type (pydantic's `ValidationError`, a `ValueError`).
    """
    out: dict[str, object] = {"commit": commit}
    results = _benches(benches, commit, "--bench")
    fan_in_results = _benches(fan_in, commit, "--fan-in")
    every = results + fan_in_results
    if every:
        gpus = {result.machine.gpu for result in every}
        if len(gpus) != 1:
            raise ValueError(f"--bench/--fan-in: results of several GPUs {sorted(map(str, gpus))}; one run, one GPU")
        out |= {
            "gpu": every[-1].machine.gpu,
            "vllm_version": every[-1].machine.vllm,
            "date": max(result.created for result in every),
            "graphs": all(not result.config.enforce_eager for result in every),
        }
    fp8: dict[str, object] = {}
    model_dtype = [result for result in results if result.config.quantization is None]
    if model_dtype:
        split = step_split(model_dtype, PRODUCT_LAYOUT)
        out["same_batch"] = _same_batch(model_dtype)
        out |= {
            "step_split": split,
            "idle_fraction": {f: {b: s["idle_fraction"] for b, s in by.items()} for f, by in split.items()},
            "wire_us_per_layer": {f: {b: s["wire_us_per_layer"] for b, s in by.items()} for f, by in split.items()},
        }
    quantized = [result for result in results if result.config.quantization == "fp8"]
    if quantized:
        fp8 |= {"same_batch": _same_batch(quantized), "step_split": step_split(quantized, PRODUCT_LAYOUT)}
    if fan_in_results:
        table: dict[str, dict[str, dict[str, object]]] = {}
        for c in compare(*(result.runs for result in fan_in_results)):
            split = step_split(fan_in_results, c.layout).get(c.family, {}).get(str(c.batch))
            entry = same_batch_entry(c) | ({"step_split": split} if split else {})
            table.setdefault(c.family, {}).setdefault(c.layout, {})[str(c.batch)] = entry
        out["fan_in"] = table
    if serve_logs:
        out["equal_tokens_run"] = equality(serve_logs, commit)
        fp8_modes = {
            family: {mode: entry for mode, entry in modes.items() if mode.endswith(_FP8_MODE)}
            for family, modes in out["equal_tokens_run"].items()
        }
        if any(fp8_modes.values()):
            fp8["equal_tokens_run"] = {family: modes for family, modes in fp8_modes.items() if modes}
    if roundtrip is not None:
        out["roundtrip_us_graph"] = json.loads(roundtrip.read_text())["roundtrip_us_graph"]
    for path, into in ((moe_layer, out), (fp8_moe_layer, fp8)):
        if path is not None:
            layer = json.loads(path.read_text())
            into["moe_layer_over_floor"] = _over_floor(layer)
            out.setdefault("gpu", layer["gpu"])
            out.setdefault("vllm_version", layer["vllm_version"])
    if fp8:
        out["fp8"] = fp8
    for key, path in (copied or {}).items():
        out[key] = _copied(path, key)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Write `--out`; print the same-batch ratios and the unequal modes. Returns 0;
    bad inputs exit with status 2 and the reason."""
    parser = argparse.ArgumentParser(prog="python -m afd_ray.bench.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", help="git commit of the run (default: git rev-parse HEAD of this checkout)")
    parser.add_argument("--bench", type=Path, nargs="*", default=[], help="bench JSONs with plain and 1A1F runs")
    parser.add_argument("--fan-in", type=Path, nargs="*", default=[], help="bench JSONs: plain and other layouts")
    parser.add_argument("--serve-logs", type=Path, nargs="*", default=[], help="tests/gpu/test_serve_one_gpu.py logs")
    parser.add_argument("--roundtrip", type=Path, help="python -m afd_ray.bench.cuda_ipc JSON")
    parser.add_argument("--moe-layer", type=Path, help="python -m afd_ray.bench.moe_layer JSON")
    parser.add_argument("--fp8-moe-layer", type=Path, help="python -m afd_ray.bench.moe_layer --quantization fp8 JSON")
    for key in _COPIED:
        flag = {"ffn_moe_over_vllm_moe": "--ffn-vs-vllm"}.get(key, f"--{key.replace('_', '-')}")
        parser.add_argument(flag, dest=key, type=Path, help=f"JSON with `{key}` (copied in)")
    parser.add_argument("--out", type=Path, required=True, help="the results file to write")
    args = parser.parse_args(argv)
    commit = args.commit or git_commit()
    if commit is None:
        parser.error("--commit: this checkout has no git commit to read; give the commit of the run")
    copied = {key: getattr(args, key) for key in _COPIED if getattr(args, key) is not None}
    try:
        summary = summarize(
            commit,
            args.bench,
            args.fan_in,
            args.serve_logs,
            args.roundtrip,
            args.moe_layer,
            copied=copied,
            fp8_moe_layer=args.fp8_moe_layer,
        )
    except ValueError as e:
        parser.error(str(e))
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    ratios = {
        f"{shape} {batch}": {k: entry[k] for k in ("tok_s_ratio", "decode_tok_s_ratio", "tpot_p50_ratio")}
        for shape, by_batch in summary.get("same_batch", {}).items()
        for batch, entry in by_batch.items()
    }
    unequal = [
        f"{family} {mode}"
        for family, modes in summary.get("equal_tokens_run", {}).items()
        for mode, entry in modes.items()
        if not entry["equal"]
    ]
    print(json.dumps({"commit": commit, "same_batch": ratios, "unequal_modes": unequal}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
