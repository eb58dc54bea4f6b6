"""Fixtures for the model-preparation tests: the embedded checkpoint and tiny ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from afd_ray.models import Family


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 folder in the real cache (`$AFD_RAY_CACHE` or
    `~/.cache/afd_ray`), so the ~25 s conversion runs once per machine, not per run."""
    from afd_ray.models.embedded import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_dir(family, seed=0)`: that tiny checkpoint, built once per session."""
    from afd_ray.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")

    def get(family: Family, seed: int = 0) -> Path:
        return build_tiny(family, root / f"{family}-seed{seed}", seed=seed)

    return get
