"""Build a checkpoint folder once, atomically."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a finished checkpoint (it has a `config.json`)."""
    return (folder / "config.json").is_file()


def build_once(out: Path, build: Callable[[Path], None]) -> Path:
    """Return `out`, first filling it with `build(tmp)` unless it is a checkpoint.

    `build` writes into an empty temporary sibling of `out`, which is renamed to `out`
    only when `build` returns, so an interrupted run never leaves a partial folder
    (a killed run may leave a hidden `.<name>-*` sibling, never a half `out`). If a
    concurrent call finishes first, its folder wins and this one is discarded.

    Raises:
        OSError: `out` exists, is not a checkpoint and is not an empty folder.
    """
    if is_checkpoint(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0o700
        try:
            tmp.rename(out)  # atomic; replaces an empty `out`
        except OSError:
            if not is_checkpoint(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
