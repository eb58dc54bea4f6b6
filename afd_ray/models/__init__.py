"""Model preparation: the embedded default checkpoint and tiny random test checkpoints.

`afd_ray.models.embedded` converts the shipped SmolLM2 GGUF and resolves
`ModelConfig.source` to a folder; `afd_ray.models.tiny` builds seeded random
checkpoints for tests. Both import torch and transformers; this facade does not, so
the CLI can list its choices without paying for those imports.
"""

from typing import Literal

from afd_ray.layers.family import MODEL_FAMILIES

__all__ = ["FAMILIES", "Family"]

FAMILIES: tuple[str, ...] = tuple(name for name, family in MODEL_FAMILIES.items() if family.tiny_config)
"""The families with a tiny test checkpoint (`ModelFamily.tiny_config` set in the
registry, `afd_ray.layers.family.MODEL_FAMILIES`)."""

Family = Literal[FAMILIES]  # built from the registry, so pydantic and argparse check names against it
"""A tiny test checkpoint family (see `afd_ray.models.tiny`)."""
