"""`afd-ray profile` and `afd-ray plan`: their subcommands for `afd_ray.cli`.

Handlers import vLLM (profile) and numpy (plan) themselves, so `afd-ray --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from afd_ray.argtypes import at_most, positive, positive_int
from afd_ray.models import FAMILIES

__all__ = ["add_plan", "add_profile"]


def _profile(args: argparse.Namespace) -> None:
    from afd_ray.plan.profile import profile_vllm

    if args.tiny is not None:
        from afd_ray.models.embedded import cache_dir
        from afd_ray.models.tiny import build_tiny

        checkpoint = build_tiny(args.tiny, cache_dir() / "tiny" / f"{args.tiny}-seed0")
    else:
        from afd_ray.config import ModelConfig
        from afd_ray.models.embedded import resolve_checkpoint

        checkpoint = resolve_checkpoint(ModelConfig(source=args.model))
    profile = profile_vllm(checkpoint, args.batches, args.prompt_tokens, args.decode_steps, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.model_dump_json(indent=2) + "\n")
    link = profile.link
    print(f"{profile.model} on {profile.device}; link: {link.latency_us:.1f} us + n / {link.bandwidth_gbps:.2f} GB/s")
    print(
        f"{'batch':>5}{'context':>9}{'step ms':>9}{'attn ms':>9}{'FFN ms':>8}{'other ms':>9}{'FFN %':>7}{'A2F+F2A B':>11}{'xfer ms':>9}  verdict"
    )
    for point, verdict in zip(profile.points, profile.verdicts, strict=True):
        print(
            f"{point.batch:>5}{point.context:>9.0f}{point.step_ms:>9.2f}{point.attention_ms:>9.2f}{point.ffn_ms:>8.2f}"
            f"{point.other_ms:>9.2f}{verdict.ffn_share:>7.0%}{verdict.bytes_per_step:>11,.0f}{verdict.transfer_ms:>9.2f}"
            f"  {'AFD can pay' if verdict.can_pay else 'AFD cannot pay'}: {verdict.reason}"
        )
    print(args.out)


def add_profile(subparsers: argparse._SubParsersAction) -> None:
    from afd_ray.plan.plan import MAX_BATCH

    profile = subparsers.add_parser(
        "profile",
        help="serve the model with plain vLLM here and split a decode step into attention, FFN/MoE "
        "and communication per batch size; say whether AFD can pay",
    )
    source = profile.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="embedded model name or checkpoint folder")
    source.add_argument("--tiny", choices=FAMILIES, help="a tiny random checkpoint of this family")
    profile.add_argument(
        "--batches",
        type=at_most(positive_int, MAX_BATCH),
        nargs="+",
        default=[1, 2, 4, 8],
        help=f"batch sizes, each at most {MAX_BATCH} (default: 1 2 4 8)",
    )
    profile.add_argument(
        "--prompt-tokens",
        type=positive_int,
        nargs="+",
        default=[32, 128],
        help="prompt lengths, tokens (default: 32 128)",
    )
    profile.add_argument(
        "--decode-steps", type=positive_int, default=16, help="decode steps timed per point (default: 16)"
    )
    profile.add_argument(
        "--threads", type=positive_int, default=1, help="engine threads, as one attention rank (default: 1)"
    )
    profile.add_argument("--out", type=Path, default=Path("profile.json"), help="profile JSON (default: profile.json)")
    profile.set_defaults(handler=_profile)


def _plan(args: argparse.Namespace) -> None:
    from afd_ray.plan.model import PerformanceModel
    from afd_ray.plan.plan import format_plan, rank_layouts
    from afd_ray.plan.profile import load_profile

    profile = load_profile(args.profile, args.model)
    model = PerformanceModel(profile, host_cores=args.host_cores)
    context = args.context if args.context is not None else max(p.context for p in profile.points)
    ranked = rank_layouts(
        model, args.devices, args.slo_tpot_ms, context, args.output_tokens, args.price_per_device_hour, args.batches
    )
    print(f"{profile.model} on {profile.device}, {args.devices} devices, context {context:.0f} tokens")
    print(format_plan(ranked, args.slo_tpot_ms, args.top))
    colocated = [p for p in profile.points if p.step_ms <= args.slo_tpot_ms]
    if colocated:
        best = max(colocated, key=lambda p: p.batch / p.step_ms)
        print(
            f"colocated, as profiled: {best.batch / best.step_ms * 1e3:.1f} tok/s per device at batch {best.batch} "
            f"(TPOT {best.step_ms:.2f} ms); AFD pays where tok/s/dev beats it"
        )
    else:
        print(f"colocated, as profiled: no batch meets TPOT <= {args.slo_tpot_ms:g} ms")


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    from afd_ray.plan.plan import DEFAULT_BATCHES, MAX_BATCH, MAX_CONTEXT, MAX_DEVICES

    plan = subparsers.add_parser(
        "plan",
        help="recommend the A:F ratio and batch per attention rank from a profile (ranked alternatives)",
    )
    plan.add_argument(
        "--profile",
        type=Path,
        required=True,
        help="`afd-ray profile` JSON, or a GPU decode benchmark JSON (benchmarks/results/h200x2-2026-11-29.json)",
    )
    plan.add_argument("--model", help="with a GPU benchmark JSON: which of its models (default: the first)")
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
        help="CPU only: cores all ranks share, fractional on a busy machine (default: one device per rank)",
    )
    plan.add_argument("--top", type=positive_int, default=10, help="alternatives to print (default: 10)")
    plan.set_defaults(handler=_plan)
