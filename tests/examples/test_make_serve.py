"""`make serve`'s cluster is one that Ray jobs can use (issue 17, item 7).

Two traps a new user hit: a job's `python -c 'import ray'` failed with `No module named
'ray'` (the job's `python` is the one on the PATH of `serve run`, not the venv's), and
`make serve` failed with `ConnectionError` on the address of a stopped `ray start`
cluster that Ray had recorded. The recipe must start its own local cluster and put the
venv's bin first on PATH. (That a job then runs the project's Python on such a cluster is
checked for real by tests/examples/test_notebooks.py, whose session cluster is started
the same way.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from afd_ray.serve.ingress_env import INGRESS_ENV

ROOT = Path(__file__).parents[2]


def test_make_serve_starts_its_own_cluster_with_the_venv_first_on_path(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    dry_run = subprocess.run(
        ["make", "-n", "serve", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    (serve_run,) = [line for line in dry_run.splitlines() if "serve run" in line]
    assert serve_run.startswith(f'PATH="{venv}/bin:$PATH" '), serve_run
    assert " --address local " in serve_run, serve_run
    assert ' RAY_SERVE_HAPROXY_BINARY_PATH="$(' in serve_run, serve_run  # HAProxy without splicing


def test_make_serve_exports_the_ingress_env() -> None:
    """`make serve`'s cluster serves HTTP as the tests' and the benchmark's do (HAProxy +
    direct ingress, `afd_ray.serve.ingress_env`): the Makefile exports `INGRESS_ENV`."""
    makefile = (ROOT / "Makefile").read_text().splitlines()
    assert all(f"export {name} := {value}" in makefile for name, value in INGRESS_ENV.items()), INGRESS_ENV
