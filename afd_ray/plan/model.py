"""The A:F performance model behind `afd-ray plan`.

Fitted from a colocated profile (`afd_ray.plan.schema.Profile`), all times per decode
step summed over the L layers, in ms:

    T_attn(b, c) = a0 + a1·b + a2·b·c        attention halves, b sequences of context c
    T_ffn(n)     = f0 + f1·n                 FFN halves on one device, n token rows
    T_other(b)   = o0 + o1·b                 embedding, LM head, sampling, scheduling
    T_x(n)       = 2·L·(λ + n·H·β / BW)       A2F + F2A over the link (λ latency per
                                             message, BW bandwidth, β bytes per element)

A layout has A attention ranks, F FFN ranks and b sequences per attention rank, so
every step the FFN side sees n = A·b rows (docs/models.md: the FFN batches the tokens of
all its attention peers). Per FFN rank:

    MoE (EP over F ranks):   T_F = (f0 + f1·n) / F + T_EP,  T_EP = 2·L·(λ + n·H·β·(F−1)/F / BW) for F > 1
                             (each rank reads 1/F of the expert weights and computes 1/F
                             of the expert rows; all-gather + reduce-scatter per layer)
    dense (no EP):           T_F = f0 + f1·⌈A/F⌉·b

Step time (= TPOT) of one attention rank:

    no overlap:  T = T_other(b) + T_attn(b, c) + T_F + T_x(b)
    DBO (two micro-batches ping-ponging between the pools, Step-3 arXiv 2507.19427 §4,
    MegaScale-Infer arXiv 2504.02263 §4 with m = 2):
                 t_a, t_f, t_x = T_attn(b/2, c)/L, T_F(n/2)/L, T_x(b/2)/L    one ubatch, one layer
                 T = T_other(b) + 2·L·max(t_a, t_f, t_x) + (t_a + t_f + t_x)    steady state + one fill

Throughput A·b / T tokens/s; SLO-goodput (requests/s) = A·b / T / output_tokens when
T ≤ the TPOT SLO, else 0 (TTFT is not modelled); cost per 1M output tokens =
price·(A + F) / 3600 / (tokens/s) · 10^6.

On a host whose ranks share `host_cores` CPU cores (the CPU test machine), the
attention phase of a step is stretched by max(1, A / host_cores) and the FFN phase by
max(1, F / host_cores): without overlap the two pools take turns, each pool's ranks
compete for the cores among themselves. `host_cores` may be fractional: on a machine
shared with other work, the cores the ranks actually get (e.g. cores × cores / load
average when the load exceeds the cores). GPUs: leave `host_cores` unset.

The traffic term is the AFD traffic per step of docs/models.md,
`bytes_per_step ≈ 2 × L × N_tokens × H × bytes_per_elem`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from afd_ray.plan.schema import Profile

__all__ = ["Estimate", "Layout", "PerformanceModel"]


@dataclass(frozen=True)
class Layout:
    """A attention ranks, F FFN ranks, `batch` sequences per attention rank, DBO on/off."""

    attention: int
    ffn: int
    batch: int
    dbo: bool = False

    @property
    def label(self) -> str:
        return f"{self.attention}A{self.ffn}F"


@dataclass(frozen=True)
class Estimate:
    """What the model predicts for one `Layout`."""

    layout: Layout
    tpot_ms: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    goodput_rps: float
    """Requests/s meeting the TPOT SLO (0 if the TPOT misses it)."""
    cost_per_1m_tokens: float
    meets_slo: bool
    attention_ms: float
    """Attention-side compute of a step (T_other + T_attn, after host sharing)."""
    ffn_ms: float
    """One FFN rank's share of a step (T_F, after host sharing)."""
    transfer_ms: float
    """T_x(b): A2F + F2A of one attention rank per step."""


def _lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares by dropping negative terms one at a time (small
    systems, at most 3 unknowns)."""
    active = list(range(len(columns)))
    while True:
        matrix = np.array([columns[i] for i in active], dtype=float).T
        coef, *_ = np.linalg.lstsq(matrix, np.array(y, dtype=float), rcond=None)
        negative = [i for i, c in zip(active, coef, strict=True) if c < 0]
        if not negative or len(active) == 1:
            out = [0.0] * len(columns)
            for i, c in zip(active, coef, strict=True):
                out[i] = max(float(c), 0.0)
            return out
        active.remove(negative[0])


class PerformanceModel:
    """The fitted model of one profile (see the module docstring for the formulas).

    Args:
        profile: colocated step times at several batch sizes (and contexts).
        host_cores: CPU cores all ranks share (may be fractional); None on GPUs (one
            device per rank).

    Raises:
        ValueError: the profile has fewer than two distinct batch sizes
            (`points[].batch`): the per-token terms cannot be fitted.
    """

    def __init__(self, profile: Profile, host_cores: float | None = None) -> None:
        points = profile.points
        if len({p.batch for p in points}) < 2:
            raise ValueError("points: a profile needs at least two distinct batch sizes")
        self.profile = profile
        self.host_cores = host_cores
        ones = [1.0] * len(points)
        batch = [float(p.batch) for p in points]
        self.attn_coef = _lstsq([ones, batch, [p.batch * p.context for p in points]], [p.attention_ms for p in points])
        self.ffn_coef = _lstsq([ones, batch], [p.ffn_ms for p in points])
        self.other_coef = _lstsq([ones, batch], [p.other_ms for p in points])
        self._row_bytes = profile.hidden_size * profile.bytes_per_elem

    def t_attn(self, batch: float, context: float) -> float:
        a0, a1, a2 = self.attn_coef
        return a0 + a1 * batch + a2 * batch * context

    def t_ffn(self, rows: float) -> float:
        f0, f1 = self.ffn_coef
        return f0 + f1 * rows

    def t_other(self, batch: float) -> float:
        o0, o1 = self.other_coef
        return o0 + o1 * batch

    def _message_ms(self, rows: float, share: float = 1.0) -> float:
        link = self.profile.link
        return link.latency_us / 1e3 + rows * self._row_bytes * share / (link.bandwidth_gbps * 1e9) * 1e3

    def t_transfer(self, rows: float) -> float:
        """A2F + F2A of `rows` token rows over all layers, ms."""
        return 2 * self.profile.num_layers * self._message_ms(rows)

    def t_ffn_rank(self, attention: int, ffn: int, batch: float) -> float:
        """One FFN rank's time per step, all layers, ms."""
        layers = self.profile.num_layers
        if not self.profile.moe:
            return self.t_ffn(math.ceil(attention / ffn) * batch)
        rows = attention * batch
        ep = 2 * layers * self._message_ms(rows, (ffn - 1) / ffn) if ffn > 1 else 0.0
        return self.t_ffn(rows) / ffn + ep

    def _stretch(self, ranks: int) -> float:
        return 1.0 if self.host_cores is None else max(1.0, ranks / self.host_cores)

    def estimate(
        self, layout: Layout, context: float, slo_tpot_ms: float, output_tokens: int, price_per_device_hour: float
    ) -> Estimate:
        """Predict one layout at mean context `context` tokens."""
        a, f, b, layers = layout.attention, layout.ffn, layout.batch, self.profile.num_layers
        attention_side = (self.t_other(b) + self.t_attn(b, context)) * self._stretch(a)
        ffn_side = self.t_ffn_rank(a, f, b) * self._stretch(f)
        transfer = self.t_transfer(b)
        if layout.dbo:
            t_a = self.t_attn(b / 2, context) * self._stretch(a) / layers
            t_f = self.t_ffn_rank(a, f, b / 2) * self._stretch(f) / layers
            t_x = self.t_transfer(b / 2) / layers
            tpot = self.t_other(b) * self._stretch(a) + 2 * layers * max(t_a, t_f, t_x) + t_a + t_f + t_x
        else:
            tpot = attention_side + ffn_side + transfer
        tokens_per_s = a * b / tpot * 1e3
        meets = tpot <= slo_tpot_ms
        return Estimate(
            layout=layout,
            tpot_ms=tpot,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_device=tokens_per_s / (a + f),
            goodput_rps=tokens_per_s / output_tokens if meets else 0.0,
            cost_per_1m_tokens=price_per_device_hour * (a + f) / 3600 / tokens_per_s * 1e6,
            meets_slo=meets,
            attention_ms=attention_side,
            ffn_ms=ffn_side,
            transfer_ms=transfer,
        )
