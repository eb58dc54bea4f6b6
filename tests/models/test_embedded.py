"""The embedded SmolLM2 checkpoint, the cache root and checkpoint resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from afd_ray.config import EMBEDDED_MODELS, ModelConfig
from afd_ray.models._folder import build_once
from afd_ray.models.embedded import (
    EMBEDDED,
    EMBEDDED_MOE,
    SMOLLM2_DIR,
    cache_dir,
    check_gate_placement,
    prepare_smollm2,
    resolve_checkpoint,
)


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AFD_RAY_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("AFD_RAY_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "afd_ray"


def test_embedded_names_match_config() -> None:
    assert set(EMBEDDED) == set(EMBEDDED_MODELS)


def test_gate_on_attention_with_a_dense_model_is_refused_before_any_replica(tmp_path: Path) -> None:
    """`build_app` accepted it; the FFN replica refused it once loading the model."""
    assert set(EMBEDDED_MOE) == set(EMBEDDED)
    dense = "gate_placement: gate_on_attention needs an MoE model; model.source {!r} is dense"
    with pytest.raises(ValueError, match=dense.format("smollm2")):
        check_gate_placement(ModelConfig(source="smollm2"), "gate_on_attention")
    check_gate_placement(ModelConfig(source="smollm2-moe"), "gate_on_attention")
    check_gate_placement(ModelConfig(source="smollm2"), "gate_on_ffn")
    for model_type in ("llama", "mixtral", "mamba"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    with pytest.raises(ValueError, match=dense.format(str(tmp_path / "llama"))):
        check_gate_placement(ModelConfig(source=str(tmp_path / "llama")), "gate_on_attention")
    check_gate_placement(ModelConfig(source=str(tmp_path / "mixtral")), "gate_on_attention")
    with pytest.raises(ValueError, match="model.source: FFN role does not support model_type 'mamba'"):
        check_gate_placement(ModelConfig(source=str(tmp_path / "mamba")), "gate_on_attention")


def test_prepare_smollm2_is_idempotent(smollm2_dir: Path) -> None:
    assert smollm2_dir == cache_dir() / "models" / SMOLLM2_DIR
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_smollm2() == smollm2_dir
    assert weights.stat().st_mtime_ns == before
    assert not list(smollm2_dir.parent.glob(f".{SMOLLM2_DIR}-*"))  # no temp leftovers
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in smollm2_dir.iterdir()}
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()


def test_smollm2_answers_paris(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_resolve_checkpoint(smollm2_dir: Path, tmp_path: Path) -> None:
    assert resolve_checkpoint(ModelConfig(source="smollm2")) == smollm2_dir
    (tmp_path / "config.json").write_text("{}")
    assert resolve_checkpoint(ModelConfig(source=str(tmp_path))) == tmp_path
    # model_construct skips ModelConfig's own check of the source.
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_checkpoint(ModelConfig.model_construct(source="no-such-model"))


def test_build_once_leaves_nothing_when_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"

    def half_build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(out, half_build)
    assert list(tmp_path.iterdir()) == []

    assert build_once(out, lambda tmp: (tmp / "config.json").write_text("{}")) == out
    assert build_once(out, half_build) == out  # complete: not rebuilt
