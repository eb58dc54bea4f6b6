"""argparse `type=` functions shared by the `afd-ray` subcommands: a bad value is a
usage error (exit status 2) that names the flag, e.g. `argument --attention: must be
>= 1, got 0`."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["at_most", "check_writable", "http_url", "positive", "positive_int"]

_Number = TypeVar("_Number", int, float)


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


def at_most(parse: Callable[[str], _Number], high: _Number) -> Callable[[str], _Number]:
    """`parse` (e.g. `positive_int`), then refuse a value above `high`."""

    def bounded(text: str) -> _Number:
        value = parse(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    bounded.__name__ = parse.__name__  # argparse's "invalid <name> value" message
    return bounded


def http_url(text: str) -> str:
    """An `http://` or `https://` address with a host (and a valid port, if any)."""
    import httpx

    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as e:
        raise argparse.ArgumentTypeError(f"not a URL ({e}): {text!r}") from e
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http(s)://host[:port], got {text!r}")
    return text


def check_writable(out: Path, flag: str = "--out") -> None:
    """Create `out`'s folder and check it can be written: run before any measurement,
    so a bad output path is not found only after minutes of work.

    Raises:
        ValueError: naming `flag`, when `out` is a folder, or its folder cannot be
            made or written.
    """
    if out.is_dir():
        raise ValueError(f"{flag}: {out} is a folder; give a file path in it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag}: {out}: {exc.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"{flag}: {out}: its folder is not writable")
