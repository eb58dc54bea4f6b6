"""The tiny Qwen3-MoE checkpoint and its plain-vLLM greedy reference, built once per
session for the e2e modules that fault an application of it (chaos, standby, soak):
each module built its own copy of the same checkpoint (seed 0) and started its own
plain vLLM engine for the same tokens. A module that needs another checkpoint
(test_eplb.py: skewed gates) defines its own `checkpoint` and `reference`."""

from __future__ import annotations

import pytest

from afd_ray.models.tiny import build_tiny
from chaos_faults import greedy_reference


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-MoE checkpoint (float32, seed 0)."""
    return str(build_tiny("qwen3_moe", tmp_path_factory.mktemp("e2e") / "qwen3_moe"))


@pytest.fixture(scope="session")
def reference(checkpoint: str) -> list[list[int]]:
    """Plain vLLM's greedy ids of each of `chaos_faults.PROMPTS` (`MAX_TOKENS`, EOS
    ignored), computed in this process by the first module that needs them, before
    its application starts (one engine at a time on 2 cores)."""
    return greedy_reference(checkpoint)
