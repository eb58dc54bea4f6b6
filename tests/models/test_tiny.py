"""Tiny random checkpoints: determinism, config invariants, tokenizer, transformers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from afd_ray.cli import main
from afd_ray.models import FAMILIES, Family
from afd_ray.models.tiny import BUILD_INFO, build_tiny, train_tokenizer

PROMPTS = ("The quick brown fox", "def main():", "Hello, my name is", "import os")
NEW_TOKENS = 16


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_bytes(family: Family, tiny_dir: Callable[..., Path], tmp_path: Path) -> None:
    first = tiny_dir(family)
    again = build_tiny(family, tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(first / name) == _sha256(again / name), name


@pytest.mark.parametrize("family", FAMILIES)
def test_other_seed_other_weights(family: Family, tiny_dir: Callable[..., Path]) -> None:
    seed0 = load_file(tiny_dir(family, seed=0) / "model.safetensors")
    seed1 = load_file(tiny_dir(family, seed=1) / "model.safetensors")
    assert seed0.keys() == seed1.keys()
    random = [name for name, t in seed0.items() if t.ndim >= 2]
    assert random
    for name in random:
        assert not torch.equal(seed0[name], seed1[name]), name


def test_reuse_and_mismatch(tiny_dir: Callable[..., Path]) -> None:
    folder = tiny_dir("llama")
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_tiny("llama", folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((folder / BUILD_INFO).read_text()) == {"family": "llama", "seed": 0}
    with pytest.raises(FileExistsError, match="seed 1"):
        build_tiny("llama", folder, seed=1)
    with pytest.raises(ValueError, match="unknown tiny family"):
        build_tiny("mixtral", folder)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_configs_fit_cpu_mla(family: Family, tiny_dir: Callable[..., Path]) -> None:
    config = AutoConfig.from_pretrained(tiny_dir(family))
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576  # vLLM CPU MLA kernel
    assert config.first_k_dense_replace == 1 and config.n_shared_experts == 1
    assert config.n_routed_experts % config.n_group == 0
    assert 1 < config.topk_group < config.n_group  # grouped routing really prunes groups
    expected = ("noaux_tc", "sigmoid") if family == "deepseek_v3" else ("group_limited_greedy", "softmax")
    assert (config.topk_method, config.scoring_func) == expected


def test_tokenizer() -> None:
    tokenizer = train_tokenizer()
    assert len(tokenizer) == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    ids = tokenizer("for x in range(10):")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "for x in range(10):"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s>user: hi</s>\nassistant: "


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_greedy_is_not_degenerate(family: Family, tiny_dir: Callable[..., Path]) -> None:
    folder = tiny_dir(family)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(set(tokens)) >= 4, (prompt, tokens)


def test_cli_models_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-llama"
    assert main(["models", "tiny", "llama", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / BUILD_INFO).read_text()) == {"family": "llama", "seed": 3}
    with pytest.raises(SystemExit) as exc:
        main(["models", "tiny", "qwen3_moe", str(out)])
    assert exc.value.code == 1
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_cli_models_prepare(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "prepare", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)


def test_cuda_mla_heads_give_deepseeks_head_sizes(tmp_path: Path) -> None:
    """vLLM's CUDA MLA prefill takes DeepSeek's own head sizes only; the build records them."""
    folder = build_tiny("deepseek_v3", tmp_path / "v3", cuda_mla_heads=True)
    config = AutoConfig.from_pretrained(folder)
    assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (
        512,
        128,
        64,
        128,
    )
    assert json.loads((folder / BUILD_INFO).read_text()) == {"family": "deepseek_v3", "seed": 0, "cuda_mla_heads": True}
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.isfinite(model(torch.tensor([[0, 5, 9]])).logits).all()
    with pytest.raises(FileExistsError, match="cuda_mla_heads"):
        build_tiny("deepseek_v3", folder)
