"""The A:F performance model behind `afd-ray plan`, and plain vLLM's at equal resources.

Fitted from a profile (`afd_ray.plan.schema.Profile`) by non-negative least squares,
all times per decode step summed over the L layers, in ms:

    T_attn(b, c) = a0 + a1·b + a2·b·c        attention halves, b sequences of context c
    T_ffn(n)     = f0 + f1·n                 FFN halves on one device, n token rows
    T_other(b)   = o0 + o1·b                 embedding, LM head, sampling, scheduling
    T_msg(n)     = λ + n·H·β / BW            one message of n rows (λ latency, BW
                                             bandwidth, β bytes per element)
    T_x(b)       = 2·L·T_msg(b)              A2F + F2A of one attention rank

The traffic term is the AFD traffic per step of docs/models.md,
`bytes_per_step ≈ 2 × L × N_tokens × H × bytes_per_elem`.

A layout has A attention ranks, F FFN ranks and b sequences per attention rank; every
step the FFN side sees n = A·b rows (docs/models.md: the FFN batches the tokens of all
its attention peers). Per FFN rank, for n rows:

    MoE (EP over F ranks):   T_F(n) = T_ffn(n) / F + T_EP(n, F)
                             T_EP(n, F) = 2·L·T_msg(n·(F−1)/F) for F > 1, else 0
                             (each rank reads 1/F of the expert weights and computes 1/F
                             of the expert rows; all-gather + reduce-scatter per layer)
    dense (no EP):           T_F(n) = T_ffn(⌈A/F⌉·n/A)

Devices. GPUs (`host_cores` None): one device per rank. Shared devices (`host_cores` =
D: the CPU cores all ranks share, fractional on a busy machine, or D = 1 for every rank
on one GPU): each pool's ranks compete for the D devices among themselves, so its
phase is stretched by s_a = max(1, A / D) and s_f = max(1, F / D).

Step time (= TPOT) of one attention rank, S_a = (T_other(b) + T_attn(b, c))·s_a:

    no DBO:  T = S_a + T_F(A·b)·s_f + T_x(b)
    DBO (`-dbo`, A ≥ 2F: each FFN rank serves its attention peers in two ubatches of
    A/2 ranks per layer, as `ffn.ubatches: 2` does; MegaScale-Infer arXiv 2504.02263
    §4's ping-pong with m = 2, Step-3 arXiv 2507.19427 §4), per layer
             t_a = T_attn(b, c)·s_a / L,  t_f = T_F(A·b/2)·s_f / L,  t_x = T_x(b) / L
      on their own devices (A + F ≤ D when shared):
             T = T_other(b)·s_a + L·max(2·t_f, t_a + t_f + t_x)
             (the FFN serves both ubatches each layer; an attention group waits for its
             own rows' FFN and wires between its layers)
      on fewer shared devices than ranks (A + F > D): nothing overlaps,
             T = S_a + 2·T_F(A·b/2)·s_f + T_x(b)

Serving (CPU): what the Serve app adds to every step of an engine with b sequences,
fitted to the profile's `serving` points (plain vLLM through the Serve app, the product
path of `afd_ray.bench`, on the cores of `plain`):

    T_serve(b)  = s0 + s1·b      fitted to  serving.tpot_ms − T_plain(b, c)  per point

It is the client-side TPOT beyond the engine's own step: streaming b tokens per step
through vLLM's OpenAI layer, the Serve replica, the `Ingress` replica and the HTTP proxy
to the client, whose processes share the host's cores with the engine's threads. The
same path serves an AFD attention rank's b sequences, so every step of both sides gets
it: T_AFD = T + T_serve(b), T_plain_app = T_plain + T_serve(b) (SmolLM2 at batch 8 on a
quiet 2-core machine: 58.8 ms per step on plain vLLM, 65.8 ms on AFD 1A:1F; that it
carries over is checked by tests/plan/check_equal_resources.py, not yet on an idle machine). Zero when the profile
has no `serving` points (CUDA: its points are measured through the app already).

Throughput A·b / T tokens/s, per device A·b / T / (A + F); SLO-goodput (requests/s) =
A·b / T / output_tokens when T ≤ the TPOT SLO, else 0 (TTFT is not modelled); cost per
1M output tokens = price·(A + F) / 3600 / (tokens/s) · 10^6.

Plain vLLM at equal resources (`PerformanceModel.plain`):

    CPU, on the profile's `plain_devices` cores (its threads), fitted to `plain`:
             T_plain(b, c) = p0 + p1·b + p2·b·c      (the engine's step)
             TPOT = T_plain(b, c) + T_serve(b)       (served through the app)
    CUDA, data parallel attention and expert parallel MoE (DP+EP) over G GPUs, b
    sequences per GPU; vLLM's own MoE layer M(n) = m0 + m1·n is fitted to what the
    plain step on one GPU leaves after the attention side,
             M fitted to  plain.step_ms − T_other(b) − T_attn(b, c)  at each plain point
             T_plain_G(b, c) = T_other(b) + T_attn(b, c) + M(G·b) / G + T_EP(G·b, G)
    (each GPU reads 1/G of the experts and computes its share of the G·b rows; the EP
    dispatch and combine cross the same link as A2F/F2A). Tokens/s G·b / T_plain_G,
    per GPU b / T_plain_G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from afd_ray.plan.schema import Profile

__all__ = ["Estimate", "Layout", "PerformanceModel", "PlainEstimate"]


@dataclass(frozen=True)
class Layout:
    """A attention ranks, F FFN ranks, `batch` sequences per attention rank, DBO on/off
    (DBO needs A ≥ 2F, as `afd_ray.bench.config.Topology` does)."""

    attention: int
    ffn: int
    batch: int
    dbo: bool = False

    def __post_init__(self) -> None:
        if self.dbo and self.attention < 2 * self.ffn:
            raise ValueError(f"layout {self.label}: DBO needs at least 2 attention ranks per FFN rank (A >= 2F)")

    @property
    def label(self) -> str:
        """`<A>A<F>F`, with `-dbo`: the bench's topology label."""
        return f"{self.attention}A{self.ffn}F" + ("-dbo" if self.dbo else "")


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
    """Attention-side compute of a step (S_a: T_other + T_attn, after device sharing)."""
    ffn_ms: float
    """One FFN rank's busy time per step (T_F, both ubatches with DBO, after sharing)."""
    transfer_ms: float
    """T_x(b): A2F + F2A of one attention rank per step."""


@dataclass(frozen=True)
class PlainEstimate:
    """Plain vLLM on `devices` cores (CPU) or GPUs (CUDA, DP+EP), `batch` sequences per
    engine (per GPU on CUDA)."""

    devices: float
    batch: int
    tpot_ms: float
    tokens_per_s: float
    tokens_per_s_per_device: float


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
        profile: step times at several batch sizes (and contexts), and plain vLLM's.
        host_cores: devices all ranks share (CPU cores, may be fractional; 1 for every
            rank on one GPU); None: one device per rank.

    Raises:
        ValueError: the profile has fewer than two distinct batch sizes in `points` or
            in `plain`: the per-token terms cannot be fitted.
    """

    def __init__(self, profile: Profile, host_cores: float | None = None) -> None:
        points, plain = profile.points, profile.plain
        if len({p.batch for p in points}) < 2:
            raise ValueError("points: a profile needs at least two distinct batch sizes")
        if len({p.batch for p in plain}) < 2:
            raise ValueError("plain: a profile needs at least two distinct batch sizes")
        self.profile = profile
        self.host_cores = host_cores
        ones = [1.0] * len(points)
        batch = [float(p.batch) for p in points]
        self.attn_coef = _lstsq([ones, batch, [p.batch * p.context for p in points]], [p.attention_ms for p in points])
        self.ffn_coef = _lstsq([ones, batch], [p.ffn_ms for p in points])
        self.other_coef = _lstsq([ones, batch], [p.other_ms for p in points])
        self._row_bytes = profile.hidden_size * profile.bytes_per_elem
        ones, batch = [1.0] * len(plain), [float(p.batch) for p in plain]
        if profile.platform == "cpu":
            self.plain_coef = _lstsq([ones, batch, [p.batch * p.context for p in plain]], [p.step_ms for p in plain])
        else:
            moe = [max(p.step_ms - self.t_other(p.batch) - self.t_attn(p.batch, p.context), 0.0) for p in plain]
            self.plain_coef = _lstsq([ones, batch], moe)
        self.serve_coef = self._fit_serving()

    def _fit_serving(self) -> list[float]:
        """(s0, s1) of T_serve fitted to the `serving` points; s1 = 0 with one batch, both 0 with none."""
        serving = self.profile.serving
        if not serving or self.profile.platform != "cpu":
            return [0.0, 0.0]
        extra = [p.tpot_ms - self.t_plain_engine(p.batch, p.context) for p in serving]
        ones, batch = [1.0] * len(serving), [float(p.batch) for p in serving]
        return _lstsq([ones, batch], extra) if len(set(batch)) > 1 else [*_lstsq([ones], extra), 0.0]

    def t_serving(self, batch: float) -> float:
        """T_serve: what serving through the app adds to a step of `batch` sequences, ms."""
        s0, s1 = self.serve_coef
        return s0 + s1 * batch

    def t_plain_engine(self, batch: float, context: float) -> float:
        """T_plain: plain vLLM's engine step on the profile's CPU cores (not served), ms."""
        p0, p1, p2 = self.plain_coef
        return p0 + p1 * batch + p2 * batch * context

    def t_attn(self, batch: float, context: float) -> float:
        a0, a1, a2 = self.attn_coef
        return a0 + a1 * batch + a2 * batch * context

    def t_ffn(self, rows: float) -> float:
        f0, f1 = self.ffn_coef
        return f0 + f1 * rows

    def t_other(self, batch: float) -> float:
        o0, o1 = self.other_coef
        return o0 + o1 * batch

    def t_message(self, rows: float) -> float:
        """T_msg: one message of `rows` token rows over the link, ms."""
        link = self.profile.link
        return link.latency_us / 1e3 + rows * self._row_bytes / (link.bandwidth_gbps * 1e9) * 1e3

    def t_transfer(self, rows: float) -> float:
        """T_x: A2F + F2A of `rows` token rows over all layers, ms."""
        return 2 * self.profile.num_layers * self.t_message(rows)

    def t_ep(self, rows: float, ranks: int) -> float:
        """T_EP: the expert-parallel exchange of `rows` rows over `ranks` ranks, all layers, ms."""
        return 2 * self.profile.num_layers * self.t_message(rows * (ranks - 1) / ranks) if ranks > 1 else 0.0

    def t_ffn_rank(self, attention: int, ffn: int, rows: float) -> float:
        """T_F: one FFN rank's time per step for `rows` rows from `attention` peers, all layers, ms."""
        if not self.profile.moe:
            return self.t_ffn(math.ceil(attention / ffn) * rows / attention)
        return self.t_ffn(rows) / ffn + self.t_ep(rows, ffn)

    def _stretch(self, ranks: int) -> float:
        return 1.0 if self.host_cores is None else max(1.0, ranks / self.host_cores)

    def tpot(self, layout: Layout, context: float) -> tuple[float, float, float, float]:
        """(T, S_a, FFN busy time, T_x) of `layout` at mean context `context`, ms; T
        includes T_serve(b)."""
        a, f, b, layers = layout.attention, layout.ffn, layout.batch, self.profile.num_layers
        s_a, s_f = self._stretch(a), self._stretch(f)
        attention_side = (self.t_other(b) + self.t_attn(b, context)) * s_a
        transfer, serve = self.t_transfer(b), self.t_serving(b)
        if not layout.dbo:
            ffn_side = self.t_ffn_rank(a, f, a * b) * s_f
            return attention_side + ffn_side + transfer + serve, attention_side, ffn_side, transfer
        half = self.t_ffn_rank(a, f, a * b / 2) * s_f
        if self.host_cores is not None and a + f > self.host_cores:
            return attention_side + 2 * half + transfer + serve, attention_side, 2 * half, transfer
        t_a, t_f, t_x = self.t_attn(b, context) * s_a / layers, half / layers, transfer / layers
        tpot = self.t_other(b) * s_a + layers * max(2 * t_f, t_a + t_f + t_x) + serve
        return tpot, attention_side, 2 * half, transfer

    def estimate(
        self, layout: Layout, context: float, slo_tpot_ms: float, output_tokens: int, price_per_device_hour: float
    ) -> Estimate:
        """Predict one layout at mean context `context` tokens."""
        a, f, b = layout.attention, layout.ffn, layout.batch
        tpot, attention_side, ffn_side, transfer = self.tpot(layout, context)
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

    def plain(self, batch: int, context: float, gpus: int = 1) -> PlainEstimate:
        """Plain vLLM at equal resources: on CPU the profile's `plain_devices` cores
        (`gpus` is ignored there), on CUDA DP+EP over `gpus` GPUs with `batch` sequences
        per GPU (module docstring)."""
        if self.profile.platform == "cpu":
            tpot = self.t_plain_engine(batch, context) + self.t_serving(batch)
            devices, engines = self.profile.plain_devices, 1
        else:
            m0, m1 = self.plain_coef
            rows = gpus * batch
            moe = (m0 + m1 * rows) / gpus + self.t_ep(rows, gpus)
            tpot = self.t_other(batch) + self.t_attn(batch, context) + moe
            devices, engines = gpus, gpus
        tokens_per_s = engines * batch / tpot * 1e3
        return PlainEstimate(devices, batch, tpot, tokens_per_s, tokens_per_s / devices)
