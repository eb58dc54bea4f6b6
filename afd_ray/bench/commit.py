"""The git commit a benchmark ran from, for its result files.

Given on the command line (`--commit`) where the code runs from a copy without
`.git` (the GPU machine), else read from the checkout that holds this package.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["CHECKOUT", "git_commit"]

CHECKOUT = Path(__file__).resolve().parents[2]
"""The folder holding the `afd_ray` package (a git checkout, or a copy without `.git`)."""

_GIT_TIMEOUT_S = 10.0


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False)


def git_commit(checkout: Path = CHECKOUT) -> str | None:
    """`git rev-parse HEAD` of `checkout`, with `-dirty` appended when a tracked file
    differs from it (`git diff --quiet HEAD`); None where `checkout` is not a git
    work tree or git is not installed. Reads only."""
    try:
        head = _git("rev-parse", "--verify", "HEAD", cwd=checkout)
        if head.returncode != 0:
            return None
        dirty = _git("diff", "--quiet", "HEAD", "--", cwd=checkout).returncode != 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")
