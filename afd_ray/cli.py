"""The `afd-ray` command line.

    afd-ray models prepare {smollm2,smollm2-moe} [--cache DIR]  # prints the checkpoint folder
    afd-ray models tiny FAMILY OUT_DIR [--seed N]      # prints OUT_DIR
    afd-ray scale --attention A --ffn F [--url URL] [--admin-key-env VAR]  # resize a running deployment
    afd-ray autoscale simulate --policy P.yaml (--trace T.jsonl | --ramp) [--out S.json] [--plot OUT.png]
    afd-ray autoscale record --url URL --out T.jsonl [--interval-s S] [--duration-s S]
    afd-ray autoscale apply --policy P.yaml [--url URL] [--admin-key-env VAR]  # reload the policy of a running app
    afd-ray profile (--model SRC | --tiny FAMILY) --out P.json  # step split, plain vLLM on every core
    afd-ray profile --platform cuda (--model SHAPE | --from-bench R.json ...) --out P.json  # via afd_ray.bench
    afd-ray plan --profile P.json --slo-tpot-ms MS --devices N [--out PLAN.json]  # A:F ratio vs plain vLLM
    afd-ray trace REQUEST_ID [--url URL] [--json]      # per-token breakdown across the pools
    afd-ray check FILE.yaml [--offline] [--address ADDR]  # every config error, before a deploy
    afd-ray dashboards export [--out dashboards/afd.json]
    afd-ray dashboards push --url GRAFANA_URL --token-env VAR [--folder-uid UID]

Each command group is one `_add_<group>(subparsers)` function that registers its
subcommands, each with a `handler(args)`; add a group (e.g. `scale`, `autoscale
simulate`) by writing another such function and listing it in `_GROUPS`. Handlers
import torch, transformers and vLLM themselves, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from afd_ray.argtypes import check_writable, http_url, positive, positive_int
from afd_ray.config import EMBEDDED_MODELS
from afd_ray.serve.check import ClusterResources, file_errors
from afd_ray.models import FAMILIES
from afd_ray.observability.cli import add_dashboards, add_trace
from afd_ray.plan.cli import add_plan, add_profile

__all__ = ["build_parser", "main"]


def _models_prepare(args: argparse.Namespace) -> None:
    from afd_ray.models.embedded import EMBEDDED

    print(EMBEDDED[args.name](args.cache))


def _models_tiny(args: argparse.Namespace) -> None:
    from afd_ray.models.tiny import build_tiny

    print(build_tiny(args.family, args.out_dir, seed=args.seed))


def _add_models(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="prepare model checkpoints")
    sub = models.add_subparsers(dest="action", required=True, metavar="ACTION")

    prepare = sub.add_parser(
        "prepare",
        help="convert an embedded model once into a safetensors folder; print its path",
    )
    prepare.add_argument("name", choices=EMBEDDED_MODELS)
    prepare.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache root (default: $AFD_RAY_CACHE or ~/.cache/afd_ray)",
    )
    prepare.set_defaults(handler=_models_prepare)

    tiny = sub.add_parser("tiny", help="build a tiny random test checkpoint (reused if already built)")
    tiny.add_argument("family", choices=FAMILIES)
    tiny.add_argument("out_dir", type=Path, help="checkpoint folder to create")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    tiny.set_defaults(handler=_models_tiny)


def _autoscale_simulate(args: argparse.Namespace) -> None:
    from afd_ray.autoscale.loader import load_policy
    from afd_ray.autoscale.simulate import (
        RampWorkload,
        changes,
        plot,
        replay,
        simulate_ramp,
    )
    from afd_ray.autoscale.trace import read_trace

    policy = load_policy(args.policy)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            check_writable(path, flag)
    if args.trace is not None:
        steps, title = (
            replay(read_trace(args.trace), policy),
            f"{args.policy} on {args.trace}",
        )
    else:
        workload = RampWorkload(peak_rps=args.peak_rps, duration_s=args.duration_s)
        steps, title = (
            simulate_ramp(workload, policy),
            f"{args.policy} on a ramp to {args.peak_rps} req/s",
        )
    t0 = steps[0].snapshot.time_s
    for step in steps if args.all else changes(steps):
        decision = step.decision
        print(
            f"t={step.snapshot.time_s - t0:7.1f}s A={decision.attention_target} F={decision.ffn_target}  {decision.reason}"
        )
    last = steps[-1].decision
    print(
        f"{len(steps)} evaluations, {len(changes(steps))} changes; final A={last.attention_target} F={last.ffn_target}"
    )
    if args.out is not None:
        rows = [
            {"snapshot": step.snapshot.model_dump(mode="json"), "decision": step.decision.model_dump(mode="json")}
            for step in steps
        ]
        args.out.write_text(json.dumps(rows) + "\n")
        print(args.out)
    png = args.plot or (args.out.with_suffix(".png") if args.out is not None else Path("autoscale.png"))
    plot(steps, png, title)
    print(png)


def _autoscale_record(args: argparse.Namespace) -> None:
    import httpx

    from afd_ray.autoscale.trace import record

    check_writable(args.out)
    try:
        lines = record(args.url, args.out, args.interval_s, args.duration_s)
    except httpx.HTTPError as e:
        raise OSError(f"{args.url}: {e}") from e
    print(f"{lines} snapshots -> {args.out}")


def _autoscale_apply(args: argparse.Namespace) -> None:
    import httpx

    from afd_ray.autoscale.loader import load_policy

    load_policy(args.policy)  # a bad field is reported here, before anything is sent
    try:
        response = httpx.post(
            f"{args.url.rstrip('/')}/afd/autoscale/policy",
            content=args.policy.read_bytes(),
            headers=_admin_headers(args.admin_key_env),
            timeout=60,
        )
    except httpx.HTTPError as e:
        raise OSError(f"{args.url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"{response.status_code}: {response.text}")
    print(response.text)


def _admin_headers(variable: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` with the admin key read from `variable` (None: none).

    Raises:
        ValueError: the variable is unset or empty (named as `--admin-key-env`).
    """
    if variable is None:
        return {}
    key = os.environ.get(variable)
    if not key:
        raise ValueError(f"--admin-key-env: environment variable {variable} is unset or empty")
    return {"Authorization": f"Bearer {key}"}


def _add_admin_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-key-env", help="environment variable holding the admin key (when the app sets ingress.admin_key_env)"
    )


def _add_autoscale(subparsers: argparse._SubParsersAction) -> None:
    autoscale = subparsers.add_parser("autoscale", help="tune the A:F autoscaling policy offline")
    sub = autoscale.add_subparsers(dest="action", required=True, metavar="ACTION")

    simulate = sub.add_parser(
        "simulate",
        help="run a policy over a recorded trace or a synthetic load ramp; print decisions, plot a PNG",
    )
    simulate.add_argument(
        "--policy",
        type=Path,
        required=True,
        help="policy YAML (e.g. deployments/autoscale.yaml)",
    )
    source = simulate.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace",
        type=Path,
        help="metrics trace (JSON lines) from `afd-ray autoscale record`",
    )
    source.add_argument(
        "--ramp",
        action="store_true",
        help="a synthetic request-rate ramp up and back down",
    )
    simulate.add_argument(
        "--peak-rps",
        type=positive,
        default=1.5,
        help="ramp peak, requests/s (default: 1.5)",
    )
    simulate.add_argument("--duration-s", type=positive, default=900.0, help="ramp length, s (default: 900)")
    simulate.add_argument(
        "--out",
        type=Path,
        help="JSON to write: every evaluation's snapshot and decision (the PNG then goes next to it)",
    )
    simulate.add_argument(
        "--plot",
        type=Path,
        help="PNG to write (default: next to --out, else autoscale.png)",
    )
    simulate.add_argument(
        "--all",
        action="store_true",
        help="print every evaluation, not only target changes",
    )
    simulate.set_defaults(handler=_autoscale_simulate)

    record = sub.add_parser("record", help="record a metrics trace from a live application's /afd/status")
    record.add_argument(
        "--url",
        type=http_url,
        default="http://127.0.0.1:8000",
        help="application URL (default: %(default)s)",
    )
    record.add_argument("--out", type=Path, required=True, help="trace file to write (JSON lines)")
    record.add_argument(
        "--interval-s",
        type=positive,
        default=1.0,
        help="seconds between snapshots (default: 1)",
    )
    record.add_argument("--duration-s", type=positive, required=True, help="how long to record, s")
    record.set_defaults(handler=_autoscale_record)

    apply = sub.add_parser(
        "apply",
        help="reload the autoscaling policy of a running application (POST /afd/autoscale/policy); "
        "validated first, a bad field is named; starts the autoscaler if the deployment had none",
    )
    apply.add_argument("--policy", type=Path, required=True, help="policy YAML to apply")
    apply.add_argument(
        "--url", type=http_url, default="http://127.0.0.1:8000", help="application URL (default: %(default)s)"
    )
    _add_admin_key(apply)
    apply.set_defaults(handler=_autoscale_apply)


def _scale(args: argparse.Namespace) -> None:
    import httpx

    url = args.url.rstrip("/")
    body = {"attention": args.attention, "ffn": args.ffn}
    headers = _admin_headers(args.admin_key_env)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{url}/afd/scale", json=body, headers=headers, timeout=args.timeout)
        _follow_resize(url, answer, args.attention + args.ffn)
        try:
            response = answer.result()
        except httpx.HTTPError as e:
            raise OSError(f"{args.url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"{response.status_code}: {response.text}")
    print(response.text)


def _follow_resize(url: str, answer: concurrent.futures.Future, target: int, poll_s: float = 1.0) -> None:
    """A tqdm bar of the ready members of both pools (out of `target`) until the
    resize `answer` (a future of the POST) is done; reads `/afd/status` each `poll_s`."""
    import httpx
    from tqdm import tqdm

    with tqdm(total=target, unit="rank", desc="resize", disable=None) as bar, httpx.Client(timeout=10) as http:
        while not answer.done():
            try:
                status = http.get(f"{url}/afd/status").raise_for_status().json()
            except httpx.HTTPError:
                status = None  # the POST reports the error; the bar only shows progress
            if status is not None:
                ready = sum(m["state"] == "ready" for pool in ("attention", "ffn") for m in status[pool])
                bar.n = min(ready, target)
                bar.set_postfix_str(f"epoch {status['epoch']}")
                bar.refresh()
            concurrent.futures.wait([answer], timeout=poll_s)


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    scale = subparsers.add_parser(
        "scale",
        help="resize the attention and FFN pools of a running deployment (POST /afd/scale); "
        "returns once the new layout serves and pauses the autoscaler",
    )
    scale.add_argument("--attention", type=positive_int, required=True, help="attention ranks")
    scale.add_argument("--ffn", type=positive_int, required=True, help="FFN ranks")
    scale.add_argument("--url", type=http_url, default="http://127.0.0.1:8000", help="the deployment's HTTP address")
    scale.add_argument("--timeout", type=positive, default=900.0, help="seconds to wait (default: 900)")
    _add_admin_key(scale)
    scale.set_defaults(handler=_scale)


def _check(args: argparse.Namespace) -> None:
    cluster, where = None, "pools not checked: --offline"
    if not args.offline:
        cluster, where = _running_cluster(args.address)
    checked, errors = file_errors(args.file, cluster)
    for error in errors:
        print(f"{args.file}: {error}", file=sys.stderr)
    if errors:
        raise ValueError(f"{args.file}: {len(errors)} error{'s' * (len(errors) > 1)}")
    print(f"{args.file}: OK ({checked} checked; {where})")


def _running_cluster(address: str | None) -> tuple[ClusterResources | None, str]:
    """The resources of a running Ray cluster (this process's, or one at `address`,
    default `RAY_ADDRESS` or the local one), never starting one; None when none runs."""
    import ray

    if ray.is_initialized():
        return ClusterResources.of_running_cluster(), "pools checked against this process's Ray cluster"
    try:
        ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR")
    except ConnectionError:
        return None, "pools not checked: no running Ray cluster"
    try:
        gcs = ray.get_runtime_context().gcs_address
        return ClusterResources.of_running_cluster(), f"pools checked against the running Ray cluster at {gcs}"
    finally:
        ray.shutdown()


def _add_check(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser(
        "check",
        help="validate a Serve config file (or an autoscaling policy) offline: each afd_ray app's args, "
        "attention.engine_args against vLLM, and the pools against a running Ray cluster's resources if "
        "one runs; prints every error with its key path, exit status 1 on an error",
    )
    check.add_argument("file", type=Path, help="Serve config YAML (e.g. deployments/afd.yaml) or policy YAML")
    check.add_argument("--offline", action="store_true", help="do not look for a running Ray cluster")
    check.add_argument("--address", help="Ray cluster to check the pools against (default: RAY_ADDRESS or local)")
    check.set_defaults(handler=_check)


_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_models,
    _add_scale,
    _add_autoscale,
    add_profile,
    add_plan,
    add_trace,
    add_dashboards,
    _add_check,
)


def build_parser() -> argparse.ArgumentParser:
    """The `afd-ray` parser; every leaf command sets `args.handler`."""
    parser = argparse.ArgumentParser(prog="afd-ray", description="Attention-FFN Disaggregation serving on Ray.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_group in _GROUPS:
        add_group(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `afd-ray` command; `argv` defaults to `sys.argv[1:]`.

    Returns the exit status (0). Bad usage exits with status 2, and a `ValueError`
    or `OSError` from the command (unknown family, a folder in the way, a missing
    package, a bad policy field) with status 1 and a one-line message on stderr.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, OSError) as e:
        parser.exit(1, f"afd-ray: error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
