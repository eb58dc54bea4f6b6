"""The pair transport between two processes on ONE GPU (`cuda_ipc`: torch symmetric
memory over CUDA IPC), which NCCL refuses ("Duplicate GPU detected").

Runs `afd_ray.bench.cuda_ipc` (the serving path's `CudaIpcPair`) briefly: the FFN side
returns `2x + 1` for every layer, and the attention side checks every byte, eager and
over 3 replays of a CUDA graph with new inputs each (the FFN side checks the top-k
bytes it got). Skips visibly without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=root, env=env, timeout=280, capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    return proc


def test_cuda_ipc_pair_exchanges_exact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "cuda_ipc.json"
    proc = _run(
        [
            sys.executable,
            "-m",
            "afd_ray.bench.cuda_ipc",
            "--out",
            str(out),
            "--tokens",
            "1",
            "16",
            "128",
            "--layers",
            "4",
            "--iters",
            "3",
            "--warmup",
            "1",
        ]
    )
    results = json.loads(out.read_text())
    assert proc.returncode == 0 and results["correct"], results
