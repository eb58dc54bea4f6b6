"""The hooks model code calls: `begin_ffn_step` at the start of a forward pass, and
`remote_ffn` / `remote_moe` at each FFN boundary.

The FFN boundary is one opaque custom op per kind, `afd_ray::remote_ffn_out` and
`afd_ray::remote_moe_out`, in the out-variant form vLLM's splitting ops take (as
`vllm::unified_attention_with_output` does): the caller allocates the `[T, H]` output
and the op writes the FFN peer's answer into it and returns nothing. torch.compile
traces around the ops (their fakes do nothing), so the A2F/F2A I/O never enters a
Dynamo graph.

Why out-variant: with vLLM's piecewise CUDA graphs (`afd_ray.attention.engine`) the
ops are splitting ops, run eagerly between captured pieces, and a captured piece
replays reading the addresses it saw at capture. The output buffer is allocated in
`remote_ffn` / `remote_moe`, which vLLM's graph split puts into the preceding piece,
so its address is the graph pool's, the same at every replay; an op returning a
fresh tensor would hand the next piece a new address each step (seen on an H200: 0
of 96 tokens equal).

`begin_ffn_step` is a plain call from the causal-LM `forward`, outside vLLM's compiled
decoder stack, so it runs on every forward pass (eager and piecewise modes). A forward
pass that is being captured into a whole-step CUDA graph (`attention.cudagraph_mode:
full_decode`) sends no header: capture runs nothing on the device, and each later
replay is announced by `announce_replay` from vLLM's runner
(`afd_ray.attention.model_state`). In that graph the ops are device work only: the
`cuda_ipc` copies and signal put/wait, at the addresses seen at capture (the peer's
slots, and `out` from the graph's pool).

The ops reach this process's `FFNClient` through one binding: the model's layers call
`attach_ffn_peer` while vLLM builds them, which opens the client on the peer of the
engine's `FFNPeerConfig` (vLLM's `additional_config`); the worker extension
(`afd_ray.attention.worker`) moves and closes it; tests that call the ops directly bind
one of their own with `use_ffn_client`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from afd_ray.attention.ffn_client import FFNClient, FFNPeerConfig, capturing

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "SPLITTING_OPS",
    "announce_replay",
    "attach_ffn_peer",
    "begin_ffn_step",
    "bound_ffn_client",
    "close_ffn_client",
    "ffn_client",
    "remote_ffn",
    "remote_moe",
    "use_ffn_client",
]

SPLITTING_OPS = ("afd_ray::remote_ffn_out", "afd_ray::remote_moe_out")
"""The FFN boundary ops, by vLLM's `namespace::name`: its piecewise capture splits at them."""

_client: FFNClient | None = None
"""The client the ops of this process use (`use_ffn_client`)."""


def use_ffn_client(client: FFNClient | None) -> None:
    """Make `client` the one the FFN boundary ops of this process exchange through
    (None: none). The caller owns it: the client bound before is not closed here."""
    global _client
    _client = client


def bound_ffn_client() -> FFNClient | None:
    """The client `use_ffn_client` bound last (None: none)."""
    return _client


def ffn_client() -> FFNClient:
    """The bound client.

    Raises:
        RuntimeError: none is bound (an AFD model runs only in an engine built with
            an `FFNPeerConfig`, `afd_ray.attention.engine.engine_args`).
    """
    if _client is None:
        raise RuntimeError("no FFN client: AFD models run only in an engine built with an FFNPeerConfig")
    return _client


def begin_ffn_step(num_tokens: int) -> None:
    """Announce a forward pass of `num_tokens` rows to the FFN peer (its STEP
    header); call once per forward pass, before the first decoder layer. Nothing is
    sent while the pass is captured into a CUDA graph (`announce_replay` announces
    its replays)."""
    if not capturing():
        ffn_client().begin_step(num_tokens)


def announce_replay(num_tokens: int) -> None:
    """Announce the replay of a captured whole-step graph of `num_tokens` rows (the
    graph's padded size): its STEP header, sent on the host before the replay."""
    ffn_client().begin_step(num_tokens, replayed=True)


@torch.library.custom_op("afd_ray::remote_ffn_out", mutates_args=("out",))
def remote_ffn_out(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """Write the FFN pool's output of decoder layer `layer` into `out`.

    Args:
        hidden: post-attention-norm hidden states `[T, H]`, model dtype.
        out: `[T, H]` (`[T, P, H]`: an MoE layer's split output), same dtype and
            device, contiguous: receives what the layer's MLP/MoE would return.
        layer: decoder layer index.
    """
    ffn_client().exchange(hidden, layer, out=out)


@remote_ffn_out.register_fake
def _(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


@torch.library.custom_op("afd_ray::remote_moe_out", mutates_args=("out",))
def remote_moe_out(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, layer: int
) -> None:
    """Write the MoE output of decoder layer `layer`, routed on the attention side
    (`gate_on_attention`), into `out`.

    Args:
        hidden: post-attention-norm hidden states `[T, H]`, model dtype.
        topk_ids: chosen experts `[T, k]` int64.
        topk_weights: their routing weights `[T, k]` float32.
        out: `[T, H]` (`[T, P, H]`: split), `hidden`'s dtype and device, contiguous:
            receives the routed (and shared) experts' output.
        layer: decoder layer index.
    """
    ffn_client().exchange(hidden, layer, (topk_ids, topk_weights), out=out)


@remote_moe_out.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


def _out(hidden: torch.Tensor, parts: int | None) -> torch.Tensor:
    """The op's output buffer: `[T, H]`, or `[T, parts, H]`; `hidden`'s dtype and device."""
    if parts is None:
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)
    return hidden.new_empty(hidden.shape[0], parts, hidden.shape[1])


def remote_ffn(hidden: torch.Tensor, layer: int, parts: int | None = None) -> torch.Tensor:
    """FFN of decoder layer `layer`, computed by the FFN pool: `hidden` `[T, H]`
    (post-attention norm, model dtype) -> `[T, H]`, same dtype and device; with
    `parts`, an MoE layer's split output `[T, parts, H]`
    (`afd_ray.layers.spec.MoEShape.split_output`)."""
    out = _out(hidden, parts)
    torch.ops.afd_ray.remote_ffn_out(hidden, out, layer)
    return out


def remote_moe(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, parts: int | None = None
) -> torch.Tensor:
    """MoE of decoder layer `layer` routed on the attention side: `hidden` `[T, H]`,
    its top-k ids `[T, k]` int64 and weights `[T, k]` float32 -> `[T, H]` (with
    `parts`: `[T, parts, H]`, as `remote_ffn`), `hidden`'s dtype and device."""
    out = _out(hidden, parts)
    torch.ops.afd_ray.remote_moe_out(hidden, topk_ids, topk_weights, out, layer)
    return out


def attach_ffn_peer(vllm_config: VllmConfig) -> None:
    """Open this process's FFN client (JOIN) on the FFN peer of
    `vllm_config.additional_config`, unless it is open there already; a client left
    bound by an earlier engine in this process is closed first (LEAVE). Nothing when
    the config is no `FFNPeerConfig` (a test binds its own client).

    Called while vLLM builds the AFD model, once per decoder layer (idempotent).

    Raises:
        RuntimeError / DistStoreError: the FFN peer did not admit it within the timeout.
    """
    config = vllm_config.additional_config
    if not isinstance(config, FFNPeerConfig):
        return
    held = bound_ffn_client()
    if held is not None and held.assignment == config.assignment:
        return
    close_ffn_client()
    use_ffn_client(FFNClient(config.assignment))


def close_ffn_client() -> None:
    """Close this process's client, if one is bound (LEAVE), and unbind it.

    Also for processes that run several AFD engines one after another in-process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as tests do): each engine needs the channel
    of its own FFN peer.
    """
    held = bound_ffn_client()
    if held is not None:
        use_ffn_client(None)
        held.close()
