"""GPU tests: they need CUDA and skip visibly without it; they import neither Ray nor
vLLM, so on the GPU machine run them without the suite's root conftest (which starts
Ray): `PYTHONPATH=. python3 -m pytest tests/gpu --confcutdir=tests/gpu -rs -s`, or
`python3 tests/gpu/test_ffn_cuda.py`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from moe_case import write_reference


@pytest.fixture(scope="session")
def reference_case(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE case's inputs and float32 CPU reference outputs (`moe_case.write_reference`),
    built once per session, only when a GPU test runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    start = time.perf_counter()
    path = write_reference(tmp_path_factory.mktemp("moe_case") / "case.pt")
    print(f"reference built in {time.perf_counter() - start:.1f} s", flush=True)
    return path
