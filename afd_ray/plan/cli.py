"""`afd-ray profile` and `afd-ray plan`: their subcommands for `afd_ray.cli`.

Handlers import vLLM (profile) and numpy (plan) themselves, so `afd-ray --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from afd_ray.argtypes import at_most, check_writable, positive, positive_int
from afd_ray.models import FAMILIES

__all__ = ["add_plan", "add_profile"]


def _read_bench(paths: list[Path]) -> list[object]:
    """`afd_ray.bench` result files. Raises ValueError naming the file and field."""
    from pydantic import ValidationError

    from afd_ray.bench import BenchResult

    results = []
    for path in paths:
        try:
            results.append(BenchResult.model_validate_json(path.read_text()))
        except OSError as e:
            raise ValueError(f"--from-bench: {path}: {e.strerror}") from None
        except ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"{path}: not an afd_ray.bench result: {first['loc']}: {first['msg']}") from e
    return results


def _profile(args: argparse.Namespace) -> None:
    check_writable(args.out)
    if args.platform == "cuda" and args.tiny is not None:
        raise ValueError(
            "--tiny: a CPU profile's random checkpoint; with --platform cuda give --model SHAPE or --from-bench"
        )
    if args.platform == "cpu" and (args.plain_threads or 0) > len(os.sched_getaffinity(0)):
        raise ValueError(
            f"--plain-threads: {args.plain_threads} is more than the {len(os.sched_getaffinity(0))} cores this "
            "process may use: plain vLLM at equal resources runs on this machine's cores"
        )
    if args.platform == "cuda":
        from afd_ray.plan.gpu import profile_cuda, profile_from_bench

        if args.from_bench:
            from afd_ray.models.shapes import SHAPES, shape_config

            results = _read_bench(args.from_bench)
            shape = results[0].config.families[0]
            if shape not in SHAPES:
                raise ValueError(f"--from-bench: {shape!r} is not a model shape ({', '.join(SHAPES)})")
            profile = profile_from_bench(results, shape_config(shape).to_dict())
        else:
            bench = {
                key: getattr(args, key)
                for key in (
                    "dtype",
                    "max_tokens",
                    "requests_per_stream",
                    "repeats",
                    "kv_cache_gib",
                    "gpu_memory_utilization",
                    "plain_gpu_memory_utilization",
                    "stream_interval",
                )
            }
            profile = profile_cuda(
                args.model, args.batches, args.prompt_tokens, bench, args.checkpoints, args.bench_out
            )
    else:
        if args.from_bench:
            raise ValueError("--from-bench: reads GPU benchmark results; use it with --platform cuda")
        from afd_ray.plan.profile import check_inputs, profile_vllm

        check_inputs(args.batches, args.prompt_tokens)

        from afd_ray.config import EMBEDDED_MODELS

        if args.tiny is not None:
            from afd_ray.models.embedded import cache_dir
            from afd_ray.models.tiny import build_tiny

            checkpoint = build_tiny(args.tiny, cache_dir() / "tiny" / f"{args.tiny}-seed0")
        else:
            from pydantic import ValidationError

            from afd_ray.config import ModelConfig
            from afd_ray.models.embedded import resolve_checkpoint

            try:
                model = ModelConfig(source=args.model)
            except ValidationError as e:
                message = e.errors()[0]["msg"].removeprefix("Value error, ").removeprefix("model.source: ")
                raise ValueError(f"--model: {message}") from None
            checkpoint = resolve_checkpoint(model)
        family = args.tiny or (args.model if args.model in EMBEDDED_MODELS else None)
        serving = []
        if args.serving and family is None:
            print(f"serving: not measured: {args.model} is a folder; the benchmark serves a family or embedded model")
        elif args.serving:
            from afd_ray.plan.serving import measure_serving

            print(f"serving: plain vLLM through the Serve app at batches {args.batches} ...")
            threads = args.plain_threads or len(os.sched_getaffinity(0))
            serving = measure_serving(family, args.batches, args.prompt_tokens[0], 2 * args.decode_steps, threads)
        profile = profile_vllm(
            checkpoint,
            args.batches,
            args.prompt_tokens,
            args.decode_steps,
            args.threads,
            args.plain_threads,
            serving=serving,
        )
    args.out.write_text(profile.model_dump_json(indent=2) + "\n")
    link = profile.link
    print(f"{profile.model} on {profile.device}; link: {link.latency_us:.1f} us + n / {link.bandwidth_gbps:.2f} GB/s")
    print(
        f"{'batch':>5}{'context':>9}{'step ms':>9}{'attn ms':>9}{'FFN ms':>8}{'other ms':>9}{'FFN %':>7}"
        f"{'AFD ms':>8}{'plain ms':>9}{'AFD/plain':>10}  verdict"
    )
    for point, verdict in zip(profile.points, profile.verdicts, strict=True):
        print(
            f"{point.batch:>5}{point.context:>9.0f}{point.step_ms:>9.2f}{point.attention_ms:>9.2f}{point.ffn_ms:>8.2f}"
            f"{point.other_ms:>9.2f}{verdict.ffn_share:>7.0%}{verdict.afd_tpot_ms:>8.2f}{verdict.plain_tpot_ms:>9.2f}"
            f"{verdict.afd_over_plain:>9.2f}x  {'AFD pays' if verdict.can_pay else 'plain vLLM wins'}"
        )
    cpu = profile.platform == "cpu"
    print(
        f"AFD 1A:1F against {f'plain vLLM on {profile.plain_devices:g} cores' if cpu else 'plain vLLM DP+EP on 2 GPUs'}; "
        f"AFD/plain: tok/s per {'core' if cpu else 'GPU'} (each verdict's reason is in {args.out})"
    )
    if profile.serving:
        from afd_ray.plan.model import PerformanceModel

        model = PerformanceModel(profile, host_cores=profile.plain_devices)
        print("plain vLLM through the Serve app: TPOT p50 = engine step + serving (T_serve fitted), ms")
        for p in profile.serving:
            engine = model.t_plain_engine(p.batch, p.context)
            print(
                f"  batch {p.batch:>4}: {p.tpot_ms:.1f} = {engine:.1f} + {p.tpot_ms - engine:.1f} (fit {model.t_serving(p.batch):.1f})"
            )
    print(args.out)


def add_profile(subparsers: argparse._SubParsersAction) -> None:
    from afd_ray.plan.plan import MAX_BATCH

    profile = subparsers.add_parser(
        "profile",
        help="split a decode step into attention, FFN/MoE and the rest per batch size, measure plain vLLM "
        "given every core (CPU) or GPU, and say whether AFD pays against it",
    )
    profile.add_argument(
        "--platform",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: vLLM engines in this machine's processes; cuda: plain vLLM and AFD 1A:1F through the "
        "Serve app on one GPU (afd_ray.bench) (default: cpu)",
    )
    source = profile.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="embedded model name or checkpoint folder; with cuda: a model shape")
    source.add_argument("--tiny", choices=FAMILIES, help="CPU: a tiny random checkpoint of this family")
    source.add_argument(
        "--from-bench", type=Path, nargs="+", help="cuda: afd_ray.bench results (plain and 1A1F runs) to read"
    )
    profile.add_argument(
        "--batches",
        type=at_most(positive_int, MAX_BATCH),
        nargs="+",
        default=[1, 2, 4, 8],
        help=f"batch sizes, at least two, each at most {MAX_BATCH} (default: 1 2 4 8)",
    )
    profile.add_argument(
        "--prompt-tokens", type=positive_int, nargs="+", default=[32, 128], help="prompt lengths (default: 32 128)"
    )
    profile.add_argument(
        "--decode-steps", type=positive_int, default=16, help="CPU: decode steps timed per point (default: 16)"
    )
    profile.add_argument(
        "--threads", type=positive_int, default=1, help="CPU: engine threads, as one rank (default: 1)"
    )
    profile.add_argument(
        "--plain-threads",
        type=positive_int,
        help="CPU: threads of plain vLLM at equal resources (default: every usable core)",
    )
    profile.add_argument(
        "--serving",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: also serve plain vLLM through the Serve app (afd_ray.bench, a private Ray cluster) at the "
        "batches, for what serving adds to every step (default: on; a tiny family or embedded model only)",
    )
    cuda = profile.add_argument_group("cuda (the benchmark's settings)")
    cuda.add_argument("--dtype", default="bfloat16", help="(default: bfloat16)")
    cuda.add_argument("--max-tokens", type=positive_int, default=256, help="output tokens per request (default: 256)")
    cuda.add_argument("--requests-per-stream", type=positive_int, default=2, help="(default: 2)")
    cuda.add_argument("--repeats", type=positive_int, default=1, help="runs of each layout and batch (default: 1)")
    cuda.add_argument("--kv-cache-gib", type=positive, default=40.0, help="KV cache per engine (default: 40)")
    cuda.add_argument("--gpu-memory-utilization", type=positive, default=0.45, help="AFD engine (default: 0.45)")
    cuda.add_argument("--plain-gpu-memory-utilization", type=positive, default=0.6, help="(default: 0.6)")
    cuda.add_argument("--stream-interval", type=positive_int, default=16, help="tokens per chunk (default: 16)")
    cuda.add_argument(
        "--checkpoints", type=Path, default=Path("/tmp/afd-shapes"), help="model shapes (default: /tmp/afd-shapes)"
    )
    cuda.add_argument("--bench-out", type=Path, help="folder to keep the benchmark's result JSONs in")
    profile.add_argument("--out", type=Path, default=Path("profile.json"), help="profile JSON (default: profile.json)")
    profile.set_defaults(handler=_profile)


def _plan(args: argparse.Namespace) -> None:
    from afd_ray.plan.model import PerformanceModel
    from afd_ray.plan.plan import format_plan, rank_layouts
    from afd_ray.plan.profile import load_profile
    from afd_ray.plan.report import plan_report

    if args.out is not None:
        check_writable(args.out)
    try:
        profile = load_profile(args.profile)
    except OSError as e:
        raise ValueError(f"--profile: {args.profile}: {e.strerror}") from None
    cpu = profile.platform == "cpu"
    host_cores = args.host_cores if args.host_cores is not None else profile.plain_devices if cpu else None
    model = PerformanceModel(profile, host_cores=host_cores)
    context = args.context if args.context is not None else max(p.context for p in profile.points)
    ranked = rank_layouts(
        model, args.devices, args.slo_tpot_ms, context, args.output_tokens, args.price_per_device_hour, args.batches
    )
    where = f"{host_cores:g} shared cores" if host_cores is not None else "one GPU per rank"
    print(f"{profile.model} on {profile.device}, {args.devices} devices ({where}), context {context:.0f} tokens")
    print(format_plan(ranked, args.slo_tpot_ms, args.top))
    profiled = max(p.batch for p in profile.points)
    if ranked[0].layout.batch > profiled:
        print(
            f"note: batch {ranked[0].layout.batch} per attention rank is beyond the profiled batches (at most "
            f"{profiled}): its times are extrapolated from the fit; profile --batches up to it to check"
        )
    measured = _read_bench(args.measured) if args.measured else []
    report, text = plan_report(model, ranked, args.slo_tpot_ms, context, args.batches, measured)
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(args.out)


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    from afd_ray.plan.plan import DEFAULT_BATCHES, MAX_BATCH, MAX_CONTEXT, MAX_DEVICES

    plan = subparsers.add_parser(
        "plan",
        help="recommend the A:F ratio and batch per attention rank from a profile, against plain vLLM "
        "on the same cores or GPUs",
    )
    plan.add_argument("--profile", type=Path, required=True, help="`afd-ray profile` JSON (CPU or cuda)")
    plan.add_argument("--slo-tpot-ms", type=positive, required=True, help="TPOT target, ms")
    plan.add_argument(
        "--devices",
        type=at_most(positive_int, MAX_DEVICES),
        required=True,
        help=f"devices for attention + FFN ranks (at most {MAX_DEVICES})",
    )
    plan.add_argument(
        "--context",
        type=at_most(positive, MAX_CONTEXT),
        help=f"mean context per sequence, tokens, at most {MAX_CONTEXT} (default: the profile's largest)",
    )
    plan.add_argument(
        "--output-tokens",
        type=positive_int,
        default=256,
        help="output tokens per request, for requests/s (default: 256)",
    )
    plan.add_argument(
        "--price-per-device-hour", type=positive, default=1.0, help="price of one device-hour (default: 1)"
    )
    plan.add_argument(
        "--batches",
        type=at_most(positive_int, MAX_BATCH),
        nargs="+",
        default=list(DEFAULT_BATCHES),
        help=f"batch sizes per attention rank to try (each at most {MAX_BATCH})",
    )
    plan.add_argument(
        "--host-cores",
        type=positive,
        help="CPU: cores all ranks share, fractional on a busy machine (default: the cores plain vLLM was "
        "profiled on); cuda: leave unset (one GPU per rank)",
    )
    plan.add_argument(
        "--measured",
        type=Path,
        nargs="+",
        help="cuda: afd_ray.bench results with 1A1F / 2A1F-dbo runs on one GPU, for `plan_check`",
    )
    plan.add_argument("--out", type=Path, help="JSON to write: plan_predictions, plan_check, same_batch, ...")
    plan.add_argument("--top", type=positive_int, default=10, help="alternatives to print (default: 10)")
    plan.set_defaults(handler=_plan)
