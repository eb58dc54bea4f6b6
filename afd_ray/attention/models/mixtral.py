"""AFD Mixtral for vLLM: Llama attention, norms, embeddings and LM head; no MoE.

A Mixtral decoder layer is a Llama decoder layer whose MLP is a sparse MoE
(`block_sparse_moe`). vLLM 0.32's `MixtralAttention` builds what `LlamaAttention`
builds from a `MixtralConfig`: no biases, `head_dim` or `hidden_size // heads`,
neox-style rope from `rope_parameters` up to `max_position_embeddings`, and the
engine-wide sliding window (neither reads a per-layer one). So the AFD Llama layer is
reused unchanged: it hands `post_attention_layernorm(attn(x) + residual)` to
`ffn_op.remote_ffn`, which returns what the layer's MoE would have. The class builds
no gate, no experts and no expert-parallel state, and loads no `block_sparse_moe.*`
tensors (see `afd_ray.weights.role_of`).

vLLM's `MixtralForCausalLM` is not a base class here: it implements
`MixtureOfExperts` (the engine would then treat the model as holding experts) and
raises without a `MixtralMoE` layer.
"""

from __future__ import annotations

from afd_ray.attention.models.llama import AFDLlamaForCausalLM

__all__ = ["AFDMixtralForCausalLM"]


class AFDMixtralForCausalLM(AFDLlamaForCausalLM):
    """Attention role of a Mixtral checkpoint (`architectures: [AFDMixtralForCausalLM]`)."""
