"""Decode steps of the GPU decode benchmark (`afd_ray.bench.decode`): the attention
role's step (its FFN remote over the connector, local, or the identity), the FFN role's
step, and running them as AFD (both ranks) or colocated (one rank), eager or in graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd_ray.bench.decode_models import AttentionStage
from afd_ray.bench.decode_pair import PairRank
from afd_ray.connector.buffers import RecvBuffers
from afd_ray.connector.ubatch import attention_layers, ffn_layers, ubatch_slices
from afd_ray.ffn.graphs import ffn_layer
from afd_ray.ffn.model import FFNStack

__all__ = ["DecodeSteps", "full_ffn", "no_ffn"]


class DecodeSteps(PairRank):
    """Builds and runs decode steps on this rank (rank 0: attention, rank 1: FFN)."""

    def _attention_step(
        self, stage: AttentionStage, batch: int, num_ubatches: int, buffers: RecvBuffers, ffn: Callable | None
    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
        """A decode step of the attention role: (step, token ids `[B]`, residual `[B, H]`)."""
        generator = torch.Generator(self.device).manual_seed(99)
        tokens = torch.randint(0, stage.shape.vocab_size, (batch,), device=self.device, generator=generator)
        residual = torch.empty(batch, stage.shape.hidden_size, dtype=self.dtype, device=self.device)
        slices = ubatch_slices(batch, num_ubatches)
        recv = [buffers.get(s.stop - s.start, u) for u, s in enumerate(slices)]

        def attend(layer: int, u: int) -> torch.Tensor:
            return stage.attend(layer, residual[slices[u]], slices[u])

        def finish(layer: int, u: int, out: torch.Tensor) -> None:
            residual[slices[u]] += out

        channel = self.channel if ffn is None else None

        def step() -> None:
            residual.copy_(stage.embed_tokens(tokens))
            attention_layers(stage.shape.num_layers, attend, finish, recv, channel=channel, ffn=ffn)
            tokens.copy_(stage.logits_argmax(residual))

        return step, tokens, residual

    def _ffn_step(
        self, stack: FFNStack, batch: int, num_ubatches: int, buffers: RecvBuffers
    ) -> Callable[[], None]:
        recv = [buffers.get(s.stop - s.start, u) for u, s in enumerate(ubatch_slices(batch, num_ubatches))]
        return lambda: ffn_layers(stack.num_layers, full_ffn(stack), recv, self.ffn_channel, 0)

    def _afd(self, stage, stack, buffers, batch: int, num_ubatches: int, graph: bool, timed: bool):
        """AFD steps on both ranks: warm-up, (capture), then `time_steps` or one step.
        Rank 0 returns (times or None, tokens, residual)."""
        self.barrier()
        if self.rank == 1:
            step = self._ffn_step(stack, batch, num_ubatches, buffers)
            self.serve(step, 1, batch)
            run = self.capture(step, True) if graph else step
            self.serve(run, self.args.warmup + self.steps_per_timing() if timed else 1, batch)
            self.sync()
            return None
        step, tokens, residual = self._attention_step(stage, batch, num_ubatches, buffers, None)
        start = tokens.clone()
        self.afd_attention(step, batch)()
        tokens.copy_(start)
        run = self.afd_attention(self.capture(step, True) if graph else step, batch)
        tokens.copy_(start)
        return self._run_or_time(run, timed), tokens, residual

    def _local(
        self,
        stage,
        ffn: Callable,
        batch: int,
        graph: bool,
        timed: bool,
        buffers: RecvBuffers,
        paired: bool = False,
    ):
        """Colocated (or attention-only) steps on this rank: (times or None, tokens,
        residual); `paired`: the FFN runs collectives with the other rank (EP)."""
        step, tokens, residual = self._attention_step(stage, batch, 1, buffers, ffn)
        start = tokens.clone()
        step()
        tokens.copy_(start)
        run = self.capture(step, paired) if graph else step
        tokens.copy_(start)
        return self._run_or_time(run, timed), tokens, residual

    def _run_or_time(self, run: Callable[[], None], timed: bool) -> dict[str, float] | None:
        """After capture: one step (`timed` False, returns None), or `--warmup` steps then
        `time_steps` over `--iters` (returns its times); the device is synchronized."""
        if not timed:
            run()
            self.sync()
            return None
        for _ in range(self.args.warmup):
            run()
        self.sync()
        return self.time_steps(run, self.args.iters)


def full_ffn(stack: FFNStack) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """FFN layer `(layer, hidden [N, H]) -> [N, H]` of a stack that holds every expert
    (`afd_ray.ffn.graphs.ffn_layer`, no EP)."""
    return lambda layer, hidden: ffn_layer(stack, None, layer, hidden, None).out


def no_ffn(layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """The FFN replaced by the identity: times the attention role alone."""
    return hidden
