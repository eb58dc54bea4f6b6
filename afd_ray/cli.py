"""The `afd-ray` command line.

    afd-ray models prepare {smollm2,smollm2-moe} [--cache DIR]  # prints the checkpoint folder
    afd-ray models tiny FAMILY OUT_DIR [--seed N]      # prints OUT_DIR

Each command group is one `_add_<group>(subparsers)` function that registers its
subcommands, each with a `handler(args)`; add a group (e.g. `scale`, `autoscale
simulate`) by writing another such function and listing it in `_GROUPS`. Handlers
import torch, transformers and vLLM themselves, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from afd_ray.config import EMBEDDED_MODELS
from afd_ray.models import FAMILIES

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

    tiny = sub.add_parser(
        "tiny", help="build a tiny random test checkpoint (reused if already built)"
    )
    tiny.add_argument("family", choices=FAMILIES)
    tiny.add_argument("out_dir", type=Path, help="checkpoint folder to create")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    tiny.set_defaults(handler=_models_tiny)


_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_models,)


def build_parser() -> argparse.ArgumentParser:
    """The `afd-ray` parser; every leaf command sets `args.handler`."""
    parser = argparse.ArgumentParser(
        prog="afd-ray", description="Attention-FFN Disaggregation serving on Ray."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_group in _GROUPS:
        add_group(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `afd-ray` command; `argv` defaults to `sys.argv[1:]`.

    Returns the exit status (0). Bad usage exits with status 2, and a `ValueError`
    or `OSError` from the command (unknown family, a folder in the way, a missing
    package) with status 1 and a one-line message on stderr.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, OSError) as e:
        parser.exit(1, f"afd-ray: error: {e}\n")
    return 0
