"""SLO-goodput and cost per output token of one benchmark run.

Raw tokens/s rewards a layout that batches harder than its users tolerate. What a
serving fleet sells is the requests that met their latency targets, at a price:

- **SLO-goodput** (requests/s): requests whose time to first token (TTFT) is at most
  `slo_ttft_ms` *and* whose mean time per output token after the first (TPOT) is at
  most `slo_tpot_ms`, divided by the load's wall time. This is the "goodput" of
  DistServe (Zhong et al., OSDI 2024) and the figure Step-3 (arXiv 2507.19427) and
  MegaScale-Infer (arXiv 2504.02263) optimise under a TPOT target.
- **Cost per 1M output tokens**: `price_per_device_hour × devices × wall_s / 3600`
  spent to produce the run's output tokens, scaled to 10^6 tokens. A device is one
  pool member (an attention rank or an FFN rank; plain vLLM is one device): on a GPU
  cluster a GPU, on the CPU benchmark a bundle of `bundle_cpus` CPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

__all__ = ["SLOResult", "slo_result"]


class SLOResult(BaseModel):
    """How much of a run met the SLOs, and what its tokens cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_met: int
    """Requests with TTFT <= `slo_ttft_ms` and TPOT <= `slo_tpot_ms`."""
    goodput_rps: float
    """`requests_met / wall_s`, requests per second."""
    met_fraction: float
    """`requests_met / requests`."""
    devices: int
    """Pool members the layout occupies (A + F; 1 for plain vLLM)."""
    cost_per_1m_output_tokens: float
    """`price_per_device_hour × devices × wall_s / 3600 / output_tokens × 10^6`, in the
    currency of `price_per_device_hour`."""


def slo_result(
    ttft_s: Sequence[float],
    tpot_s: Sequence[float],
    wall_s: float,
    output_tokens: int,
    devices: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    price_per_device_hour: float,
) -> SLOResult:
    """Goodput and cost of one run.

    Args:
        ttft_s, tpot_s: per request, seconds, same order and length (at least one).
        wall_s: first request sent until the last finished, seconds (> 0).
        output_tokens: output tokens of all requests (> 0).
        devices: pool members of the layout (>= 1).
        slo_ttft_ms, slo_tpot_ms: the targets, milliseconds.
        price_per_device_hour: price of one device for one hour.

    Raises:
        ValueError: the per-request lists differ in length or are empty.
    """
    if len(ttft_s) != len(tpot_s) or not ttft_s:
        raise ValueError(f"ttft_s ({len(ttft_s)}) and tpot_s ({len(tpot_s)}): one value per request, at least one")
    met = sum(
        1 for ttft, tpot in zip(ttft_s, tpot_s, strict=True) if ttft * 1e3 <= slo_ttft_ms and tpot * 1e3 <= slo_tpot_ms
    )
    cost = price_per_device_hour * devices * wall_s / 3600
    return SLOResult(
        requests_met=met,
        goodput_rps=met / wall_s,
        met_fraction=met / len(ttft_s),
        devices=devices,
        cost_per_1m_output_tokens=cost / output_tokens * 1e6,
    )
