"""Model preparation: the embedded default checkpoint and tiny random test checkpoints.

`afd_ray.models.embedded` converts the shipped SmolLM2 GGUF and resolves
`ModelConfig.source` to a folder; `afd_ray.models.tiny` builds seeded random
checkpoints for tests. Both import torch and transformers; this facade does not, so
the CLI can list its choices without paying for those imports.
"""

from typing import Literal, get_args

__all__ = ["FAMILIES", "Family"]

Family = Literal["llama", "qwen3_moe", "deepseek_v3", "deepseek_v2"]
"""A tiny test checkpoint family (see `afd_ray.models.tiny`)."""

FAMILIES: tuple[Family, ...] = get_args(Family)
