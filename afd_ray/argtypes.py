"""argparse `type=` functions shared by the `afd-ray` subcommands: a bad value is a
usage error (exit status 2) that names the flag, e.g. `argument --attention: must be
>= 1, got 0`."""

from __future__ import annotations

import argparse
import math

__all__ = ["positive", "positive_int"]


def positive(text: str) -> float:
    """A duration, rate or amount that must be finite and > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
    return value


def positive_int(text: str) -> int:
    """A count that must be >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value
