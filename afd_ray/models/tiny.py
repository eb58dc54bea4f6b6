"""Tiny random test checkpoints, deterministic under a seed.

Each family is a few layers of width 128 with a 512-token byte-level BPE vocabulary,
small enough to start in vLLM CPU in seconds. They exercise the code paths of the real
models: dense Llama (GQA), Qwen3-MoE (softmax top-k routing),
DeepSeek-V2 (MLA, shared expert, group-limited greedy routing) and DeepSeek-V3 (MLA
with a q LoRA, shared expert, grouped sigmoid routing with a score-correction bias).

The DeepSeek models keep `kv_lora_rank=512` and `qk_rope_head_dim=64`: vLLM's CPU MLA
kernel only supports a latent size of 576. On CUDA, vLLM's MLA prefill
(`FLASH_ATTN`, vLLM 0.26 `mla/prefill/flash_attn.py`) accepts only DeepSeek's own
head sizes (qk_nope 128, qk_rope 64, v 128) among the small ones, so
`cuda_mla_heads=True` builds the DeepSeek families with those.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

from afd_ray.layers.family import MODEL_FAMILIES
from afd_ray.models import FAMILIES, Family
from afd_ray.models._folder import build_once, is_checkpoint

__all__ = ["BUILD_INFO", "build_tiny", "quantize_fp8_checkpoint", "tiny_config", "train_tokenizer"]

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"  # token ids 0 and 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
BUILD_INFO = "afd_ray_tiny.json"
"""File in each tiny folder recording the family and seed it was built from."""

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    tie_word_embeddings=False,
    dtype="float32",
)
_MLA = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
    num_key_value_heads=4,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    moe_intermediate_size=64,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,  # 2 experts per group
    topk_group=2,
)


def tiny_config(family: Family, cuda_mla_heads: bool = False) -> PreTrainedConfig:
    """The transformers config of one tiny family (float32, vocab 512, hidden 128);
    with `cuda_mla_heads`, the DeepSeek families get DeepSeek's MLA head sizes
    (qk_nope 128, v 128) that vLLM's CUDA MLA prefill needs. The family's builder is
    the registry's `ModelFamily.tiny_config` (`afd_ray.layers.family`).

    Raises:
        ValueError: unknown `family`.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {FAMILIES}")
    module, name = MODEL_FAMILIES[family].tiny_config.split(":")
    builder: Callable[[bool], PreTrainedConfig] = getattr(importlib.import_module(module), name)
    return builder(cuda_mla_heads)


def llama_config(cuda_mla_heads: bool) -> LlamaConfig:
    """Tiny dense Llama (GQA), 2 layers; `cuda_mla_heads` does not apply (no MLA)."""
    return LlamaConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
    )


def qwen3_moe_config(cuda_mla_heads: bool) -> Qwen3MoeConfig:
    """Tiny Qwen3-MoE, 2 layers of 8 experts, top-2 renormalized; `cuda_mla_heads` does
    not apply (no MLA)."""
    return Qwen3MoeConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )


def deepseek_v2_config(cuda_mla_heads: bool) -> DeepseekV2Config:
    """Tiny DeepSeek-V2: MLA without q LoRA, group-limited greedy softmax routing."""
    config = DeepseekV2Config(
        **_COMMON,
        **_mla(cuda_mla_heads),
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    config.scoring_func = "softmax"
    return config


def deepseek_v3_config(cuda_mla_heads: bool) -> DeepseekV3Config:
    """Tiny DeepSeek-V3: MLA with a q LoRA, grouped sigmoid routing with a bias."""
    config = DeepseekV3Config(
        **_COMMON,
        **_mla(cuda_mla_heads),
        q_lora_rank=64,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_mtp_layers=0,  # no multi-token-prediction weights are saved
    )
    # Read by vLLM (transformers' V3 always routes this way).
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def _mla(cuda_mla_heads: bool) -> dict[str, object]:
    return _MLA | ({"qk_nope_head_dim": 128, "v_head_dim": 128} if cuda_mla_heads else {})


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A 512-token byte-level BPE trained on the stdlib's `pydoc_data.topics`.

    Deterministic (same merges on every call, about 0.2 s). Ids 0 and 1 are `<s>`
    (bos, prepended to plain text) and `</s>` (eos and pad); the chat template renders
    `<s>`, then `role: content</s>\\n` per message, then `assistant: `.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((topics[key] for key in sorted(topics)), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
    )


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every weight from one generator seeded with `seed`, in name order.

    Matrices, the embedding included, get N(0, 1/fan_in): activations stay O(1)
    through the layers, logits come out with a spread of about 1 (clear greedy
    winners), and the token embedding stays small against the layer outputs, so a
    tied lm_head does not just repeat the last token. Norms get 1,
    DeepSeek-V3's `e_score_correction_bias` N(0, 0.05^2), other biases 0.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, t in sorted(model.state_dict().items()):
        if t.data_ptr() in seen:  # tied lm_head
            continue
        seen.add(t.data_ptr())
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
        elif t.ndim >= 2:  # [out, in] or experts [E, out, in]
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)
        elif name.endswith("weight"):  # RMSNorm
            t.fill_(1.0)
        else:
            t.zero_()


@torch.no_grad()
def _skew_routers(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, skew: float) -> None:
    """Make two experts per MoE layer hot, all in the first half of the experts:
    `(2j, 2j + 1) mod E/2` in the j-th MoE layer, so that a contiguous EP2 placement
    puts every hot expert on EP rank 0 (EPLB tests). Their router rows get `skew` times
    the unit mean direction of the layer's gate inputs over a fixed text, divided by
    that mean's norm: a typical token's gate logit of a hot expert rises by about
    `skew`, against logits spread about 1."""
    inputs: dict[int, torch.Tensor] = {}
    gates = [(name, m) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [
        gate.register_forward_hook(
            lambda _, args, __, j=j: inputs.__setitem__(j, args[0].reshape(-1, args[0].shape[-1]))
        )
        for j, (_, gate) in enumerate(gates)
    ]
    try:
        model(**tokenizer(" ".join(_SKEW_TEXT), return_tensors="pt"))
    finally:
        for hook in hooks:
            hook.remove()
    for j, (_, gate) in enumerate(gates):
        mean = inputs[j].mean(dim=0)  # [H]
        half = gate.weight.shape[0] // 2
        for expert in ((2 * j) % half, (2 * j + 1) % half):
            gate.weight[expert] += skew * mean / mean.norm() ** 2


_SKEW_TEXT = ("The quick brown fox", "def main():", "Hello, my name is", "import os", "In the beginning")


def _build(family: Family, seed: int, out: Path, cuda_mla_heads: bool, skew: float = 0.0) -> None:
    config = tiny_config(family, cuda_mla_heads)
    tokenizer = train_tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens > vocab {config.vocab_size}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    if skew:
        _skew_routers(model, tokenizer, skew)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / BUILD_INFO).write_text(json.dumps(_build_info(family, seed, cuda_mla_heads, skew)) + "\n")


def _build_info(family: Family, seed: int, cuda_mla_heads: bool, skew: float = 0.0) -> dict[str, object]:
    info: dict[str, object] = {"family": family, "seed": seed}
    return info | ({"cuda_mla_heads": True} if cuda_mla_heads else {}) | ({"router_skew": skew} if skew else {})


def build_tiny(family: Family, out_dir: Path, seed: int = 0, cuda_mla_heads: bool = False, skew: float = 0.0) -> Path:
    """Build the tiny `family` checkpoint into `out_dir` (once) and return `out_dir`.

    The folder holds `config.json`, `model.safetensors` (float32, about 1-4 MB),
    `generation_config.json`, the tokenizer of `train_tokenizer()` and `BUILD_INFO`.
    The same `(family, seed, cuda_mla_heads)` gives byte-identical weights; a folder
    already built from them is reused. `cuda_mla_heads`: see `tiny_config`. `skew`:
    two experts per MoE layer get most rows, their gate logits raised by about this
    much (`_skew_routers`, for EPLB tests); 0 leaves the routers as drawn.

    Raises:
        ValueError: unknown `family`.
        FileExistsError: `out_dir` holds a checkpoint of another family or seed.
        OSError: `out_dir` exists and is neither a checkpoint nor an empty folder.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {FAMILIES}")
    if is_checkpoint(out_dir):
        info = out_dir / BUILD_INFO
        built = json.loads(info.read_text()) if info.is_file() else None
        if built != _build_info(family, seed, cuda_mla_heads, skew):
            raise FileExistsError(
                f"{out_dir} already holds a checkpoint ({built or 'not a tiny build'}), "
                f"not tiny {family} seed {seed}{' with cuda_mla_heads' if cuda_mla_heads else ''}"
            )
    return build_once(Path(out_dir), lambda tmp: _build(family, seed, tmp, cuda_mla_heads, skew))


_FP8_LINEAR = re.compile(r"^model\.layers\.\d+\..*(?:_proj|\.w[123])\.weight$")
"""The linear weights an FP8 checkpoint stores in FP8 (DeepSeek-V3's layout): every
projection of a decoder layer; not the router gate, norms, embeddings or LM head."""


def quantize_fp8_checkpoint(src: Path, out: Path, block_shape: tuple[int, int] | None) -> Path:
    """Write an FP8 copy of checkpoint `src` into `out` (created) and return `out`: what
    DeepSeek-V3 and Qwen3-FP8 ship, for tests.

    Every decoder-layer projection weight `W [N, K]` (`_FP8_LINEAR`) becomes
    float8_e4m3fn `round(W / s)` with `s` = amax / 448 of each `block_shape` block,
    saved as `....weight_scale_inv` `[ceil(N / bn), ceil(K / bk)]` float32 (block), or
    of the whole tensor, saved as `....weight_scale` `[]` float32 (`block_shape`
    None); other tensors are copied. config.json gets `quantization_config`
    (`quant_method: fp8`, `activation_scheme: dynamic`, `weight_block_size`); the other
    files (tokenizer, ...) are copied. `W.float() * s` (`afd_ray.layers.fp8.dequantize_fp8`)
    is within FP8 rounding (2^-4 relative) of `W`.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    fp8, largest = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                weight = f.get_tensor(name)
                if not _FP8_LINEAR.match(name):
                    tensors[name] = weight
                    continue
                if block_shape is None:
                    scale = (weight.float().abs().amax() / largest).clamp(min=1e-12)
                    full = scale
                else:
                    rows, cols = weight.shape
                    bn, bk = block_shape
                    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
                    padded[:rows, :cols] = weight.float().abs()
                    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
                    scale = (blocks.amax(dim=(1, 3)) / largest).clamp(min=1e-12)  # [N/bn, K/bk]
                    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
                tensors[name] = (weight.float() / full).clamp(-largest, largest).to(fp8)
                suffix = "weight_scale" if block_shape is None else "weight_scale_inv"
                tensors[name.removesuffix("weight") + suffix] = scale.float().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(path, out / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"} | (
        {"weight_block_size": list(block_shape)} if block_shape else {}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
