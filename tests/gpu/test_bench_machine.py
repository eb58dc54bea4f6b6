"""`afd_ray.bench.runner.machine` on CUDA names the GPU without initializing CUDA in
the benchmark's process (NVML through vLLM's platform). With `torch.cuda.get_device_name`
the process connected to the MPS server at the end of a run, which failed there on
2026-12-07 (H100: "MPS server is not ready to accept new MPS client requests") and lost
the run's whole result. Skips visibly without a CUDA device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

_PROBE = """
import json, torch
from afd_ray.bench.runner import machine
host = machine()
print(json.dumps({"gpu": host.gpu, "cuda_initialized": torch.cuda.is_initialized()}))
"""


@pytest.mark.timeout(120)
def test_machine_names_the_gpu_without_initializing_cuda() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["gpu"] == torch.cuda.get_device_name(0)
    assert probe["cuda_initialized"] is False
