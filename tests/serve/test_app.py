"""`build_app` rejects bad YAML `args` before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from afd_ray.models.tiny import build_tiny
from afd_ray.serve.app import build_app


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"attention": {"num_ranks": 0}}, "attention.num_ranks"),
        ({"attention": {"num_rank": 2}}, "attention.num_rank"),
        ({"platform": "tpu"}, "platform"),
        ({"ingress": {"max_ongoing_requests": -1}}, "ingress.max_ongoing_requests"),
    ],
    ids=["out-of-bounds", "typo", "unknown-platform", "negative-ingress-limit"],
)
def test_invalid_args_name_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as error:
        build_app(args)
    (only,) = error.value.errors()
    assert ".".join(str(part) for part in only["loc"]) == field
    assert field in str(error.value)


def test_ep_idle_backoff_below_its_start_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"ffn\.ep_idle_max_check_us: 1000 < ffn\.ep_idle_check_us 2000"):
        build_app({"ffn": {"ep_idle_max_check_us": 1000}})


def test_gate_on_attention_with_a_dense_model_is_refused() -> None:
    """Accepted here; the FFN replica refused it once loading the model."""
    with pytest.raises(ValueError, match="gate_placement: gate_on_attention needs an MoE model; model.source 'smol"):
        build_app({"gate_placement": "gate_on_attention"})


def test_gate_on_attention_with_a_dense_folder_is_refused(tmp_path: Path) -> None:
    """A folder source's `config.json` is read at build time."""
    folder = build_tiny("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="gate_placement: gate_on_attention needs an MoE model"):
        build_app({"gate_placement": "gate_on_attention", "model": {"source": str(folder)}})
