"""`afd-ray profile --platform cuda`: the profile of a model on one GPU, measured
through the product path: the benchmark (`afd_ray.bench.runner.run_benchmark`) serves
plain vLLM and AFD 1A:1F (both on one GPU, `cuda_ipc` between the two ranks) through
the real Serve app at every batch and prompt length, and the profile is read off its
result:

- attention step time against batch and context, FFN layer time against T and wire
  time against T: the FFN rank's step split of each 1A:1F run (`StepSplitResult`,
  CUDA events on the FFN rank's stream) at batch b (T = b rows, context = prompt +
  half the output):
      attention_ms = split.attention_ms − split.wire_ms   (its waits for rows hold the
                                                            A2F transfer, taken as
                                                            long as the F2A one)
      ffn_ms       = split.ffn_ms                          (all layers; per layer ÷ L)
      comm_ms      = 2 × split.wire_ms                     (A2F + F2A)
      other_ms     = split.idle_ms                         (sampling, scheduling, the
                                                            attention work before layer 0)
- the link: `wire_ms / L`, one F2A message per layer, fitted against T to
  `latency + T × H × bytes_per_elem / bandwidth` (`afd_ray.plan.link.fit_link`);
- plain vLLM: each plain run's TPOT p50 at its batch and context (`PlainPoint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from afd_ray.plan.link import fit_link
from afd_ray.plan.profile import verdicts
from afd_ray.plan.schema import PlainPoint, Profile, StepPoint

__all__ = ["profile_cuda", "profile_from_bench"]

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def profile_from_bench(results: Sequence[object], model_config: dict[str, object]) -> Profile:
    """A CUDA `Profile` from benchmark results (`afd_ray.bench.BenchResult`s) holding
    `plain` and `1A1F` runs of one model (module docstring).

    Args:
        results: the runs; their `1A1F` runs need a step split.
        model_config: the checkpoint's `config.json` (layers, hidden size, experts).

    Raises:
        ValueError: no `1A1F` run with a split or no `plain` run, fewer than two
            distinct batches in either, or more than one model in `results`.
    """
    families = {family for result in results for family in result.config.families}
    if len(families) != 1:
        raise ValueError(f"results: one model's runs are needed, got {sorted(families)}")
    layers, hidden = int(model_config["num_hidden_layers"]), int(model_config["hidden_size"])
    points, plain, wires = [], [], []
    for result in results:
        for run in result.runs:
            context = run.prompt_tokens + result.config.max_tokens / 2
            if run.label == "plain":
                plain.append(PlainPoint(batch=run.concurrency, context=context, step_ms=run.tpot.p50_ms))
            elif run.label == "1A1F" and run.ffn and run.ffn[0].split is not None:
                split = run.ffn[0].split
                points.append(
                    StepPoint(
                        batch=run.concurrency,
                        context=context,
                        step_ms=split.step_ms,
                        attention_ms=max(split.attention_ms - split.wire_ms, 0.0),
                        ffn_ms=split.ffn_ms,
                        comm_ms=2 * split.wire_ms,
                    )
                )
                wires.append((run.concurrency, split.wire_ms / layers / 1e3))
    if not points or not plain:
        raise ValueError("results: need `plain` runs and `1A1F` runs with a step split (python -m afd_ray.bench)")
    dtype = results[0].config.dtype
    row_bytes = hidden * _BYTES[dtype]
    tokens, seconds = zip(*wires, strict=True)
    link = fit_link(
        tokens,
        [2 * s for s in seconds],  # fit_link takes round trips: two messages
        row_bytes,
        "1A1F step split: F2A wire_ms per layer against T",
    )
    machine = results[0].machine
    profile = Profile(
        model=next(iter(families)),
        device=f"{machine.gpu} (one GPU, plain vLLM and AFD 1A:1F)",
        source=f"afd-ray profile --platform cuda: afd_ray.bench (vLLM {machine.vllm}), step split + TPOT p50",
        platform="cuda",
        num_layers=layers,
        hidden_size=hidden,
        bytes_per_elem=_BYTES[dtype],
        moe=any(key in model_config for key in ("num_experts", "num_local_experts", "n_routed_experts")),
        points=points,
        plain=plain,
        plain_devices=1,
        link=link,
    )
    return profile.model_copy(update={"verdicts": verdicts(profile)})


def profile_cuda(
    model: str,
    batches: Sequence[int],
    prompt_tokens: Sequence[int],
    bench: dict[str, object],
    checkpoints: Path,
    bench_out: Path | None = None,
) -> Profile:
    """Measure `model` (a shape of `afd_ray.models.shapes`, random weights) on this
    machine's GPU through the benchmark: plain and 1A:1F, CUDA graphs on both sides, at
    every batch in `batches`, once per prompt length in `prompt_tokens`.

    Args:
        bench: further `BenchConfig` fields (dtype, kv_cache_gib, memory fractions,
            ...), `max_tokens` among them.
        bench_out: folder for the benchmark's own result JSONs (kept for the record).

    Raises:
        ValueError: a bad benchmark setting (names the field); see `profile_from_bench`.
        afd_ray.bench.load.LoadError, RuntimeError, TimeoutError: see `run_benchmark`.
    """
    from afd_ray.bench.cli import serve_endpoint
    from afd_ray.bench.config import BenchConfig
    from afd_ray.bench.runner import run_benchmark
    from afd_ray.models.shapes import shape_config

    cfgs = [
        BenchConfig.model_validate(
            {
                "platform": "cuda",
                "families": [model],
                "topologies": ["plain", "1A1F"],
                "concurrency": list(batches),
                "prompt_tokens": length,
                "enforce_eager": False,
                "checkpoints": checkpoints,
                "max_model_len": length + int(bench["max_tokens"]) + 8,
                **bench,
            }
        )
        for length in prompt_tokens
    ]
    results = []
    with serve_endpoint(cfgs[0], None, None) as url:
        for cfg in cfgs:
            result = run_benchmark(cfg, url)
            if bench_out is not None:
                bench_out.mkdir(parents=True, exist_ok=True)
                name = f"profile-{model}-{cfg.prompt_tokens}.json"
                (bench_out / name).write_text(result.model_dump_json(indent=2) + "\n")
            results.append(result)
    return profile_from_bench(results, shape_config(model).to_dict())
