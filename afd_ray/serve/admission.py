"""Admission at the ingress (docs/failures.md): admit a request only if both pools can take
it, else refuse it at once with 429 (or 503 while the pools resize or recover from a
lost FFN rank) and `Retry-After`,
instead of queueing without bound.

A request is admitted in two steps. Before its body is read (`Admission.reserve`: a
refused request costs no body transfer and no parsing):
- queue room: fewer than `capacity` = READY attention ranks x
  (`attention.max_num_seqs` + `ingress.max_queued_per_rank`) requests in flight at this
  ingress replica (counted exactly: +1 on `reserve`, -1 when its answer ends);
- KV headroom: the attention ranks' KV-cache usage below `ingress.max_kv_cache_usage`;
- FFN load: the FFN ranks' token rows per step below `ingress.max_ffn_tokens_per_step`.

Once its body is read (`Admission.admit`): its deadline, if any
(`x-request-deadline-ms`), is feasible: the pool's p90 time to first token plus
`max_tokens` x its p90 time per output token fits in it (without samples yet, every
deadline is feasible).

The load figures come from the coordinator (`PoolLoad`), read every `LOAD_PERIOD_S`
in the background; the in-flight count is the ingress's own. No call leaves the
ingress while deciding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus

from afd_ray.config import IngressConfig
from afd_ray.control.membership import AdmissionState, PoolLoad

__all__ = ["DEADLINE_HEADER", "LOAD_PERIOD_S", "Admission", "Refusal"]

DEADLINE_HEADER = "x-request-deadline-ms"
"""Optional request header: the client's time budget for the whole answer, in
milliseconds from its arrival at the ingress (a positive integer)."""
LOAD_PERIOD_S = 0.25
"""How often the ingress reads `PoolLoad` from the coordinator, seconds."""


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted: `status` 429 or 503, `message` names the bound."""

    status: HTTPStatus
    message: str


class Admission:
    """The admission state of one ingress replica (not thread-safe: the ingress's event
    loop is its only user).

    Args:
        ingress: the bounds (`max_queued_per_rank`, `max_kv_cache_usage`,
            `max_ffn_tokens_per_step`).
        max_num_seqs: requests one attention engine runs at once (`attention.max_num_seqs`).
    """

    def __init__(self, ingress: IngressConfig, max_num_seqs: int) -> None:
        self._cfg = ingress
        self._per_rank = max_num_seqs + ingress.max_queued_per_rank
        self.load: PoolLoad | None = None
        self._load_time = 0.0
        self.in_flight = 0
        self._admitted = self._refused_429 = self._refused_503 = self._expired = self._resumed = 0
        self._last_refusal: str | None = None

    def update(self, load: PoolLoad) -> None:
        """The coordinator's latest `PoolLoad`."""
        self.load, self._load_time = load, time.monotonic()

    @property
    def capacity(self) -> int:
        """Requests the pools may hold at once: READY attention ranks x
        (`max_num_seqs` + `max_queued_per_rank`); 0 before the first load."""
        return 0 if self.load is None else self.load.attention_ranks * self._per_rank

    def reserve(self) -> Refusal | None:
        """Reserve a place for one request whose body is not read yet, on the bounds
        that need no body (ready ranks, queue room, KV headroom, FFN load), or say why
        not (counted as refused). A reserved place counts in flight until `release`,
        whatever `admit` then decides."""
        refusal = self._check()
        if refusal is not None:
            self._refuse(refusal)
        else:
            self.in_flight += 1
        return refusal

    def admit(self, deadline_s: float | None = None, max_tokens: int | None = None) -> Refusal | None:
        """Admit a request that holds a place (`reserve`), once its body is read, or
        say why not (its deadline cannot be met); counted as admitted or refused. The
        place is given back by `release` either way.

        Args:
            deadline_s: the request's time budget from now, seconds (None: none).
            max_tokens: tokens it may generate (None: unknown; only the time to first
                token is checked against the deadline).
        """
        load = self.load
        if deadline_s is not None and load is not None:
            estimate = load.ttft_p90_s + (max_tokens or 0) * load.tpot_p90_s
            if estimate > deadline_s:
                refusal = Refusal(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"{DEADLINE_HEADER}: {deadline_s * 1e3:.0f} ms cannot be met (p90 time to first "
                    f"token {load.ttft_p90_s * 1e3:.0f} ms + {max_tokens or 0} tokens x p90 time per "
                    f"output token {load.tpot_p90_s * 1e3:.1f} ms)",
                )
                self._refuse(refusal)
                return refusal
        self._admitted += 1
        return None

    def _refuse(self, refusal: Refusal) -> None:
        if refusal.status == HTTPStatus.SERVICE_UNAVAILABLE:
            self._refused_503 += 1
        else:
            self._refused_429 += 1
        self._last_refusal = refusal.message

    def not_ready(self) -> Refusal | None:
        """The 503 refusal of any request while no attention rank is READY (the
        application is starting, or every attention rank is being replaced), or None."""
        if self.load is None or self.load.attention_ranks == 0:
            return Refusal(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "no attention rank is ready: the application is starting "
                "(or its attention ranks are being replaced); see GET /afd/status",
            )
        return None

    def _check(self) -> Refusal | None:
        load, cfg = self.load, self._cfg
        if load is None or load.attention_ranks == 0:
            return self.not_ready()
        changing = load.resizing or load.recovering
        status = HTTPStatus.SERVICE_UNAVAILABLE if changing else HTTPStatus.TOO_MANY_REQUESTS
        during = ""
        if load.resizing:
            during = " (the pools are resizing)"
        elif load.recovering:
            during = " (lost FFN ranks are being replaced)"
        if self.in_flight >= self.capacity:
            return Refusal(
                status,
                f"{self.in_flight} requests in flight, the capacity of {load.attention_ranks} "
                f"attention ranks is {self.capacity} (attention.max_num_seqs + "
                f"ingress.max_queued_per_rank per rank){during}",
            )
        if load.kv_cache_usage >= cfg.max_kv_cache_usage:
            return Refusal(
                status,
                f"KV cache {load.kv_cache_usage:.0%} used, at or above "
                f"ingress.max_kv_cache_usage {cfg.max_kv_cache_usage:.0%}{during}",
            )
        bound = cfg.max_ffn_tokens_per_step
        if bound is not None and load.ffn_tokens_per_step >= bound:
            return Refusal(
                status,
                f"FFN ranks run {load.ffn_tokens_per_step:.0f} token rows per step, at or above "
                f"ingress.max_ffn_tokens_per_step {bound}{during}",
            )
        return None

    def release(self, expired: bool = False) -> None:
        """A reserved request's place is given back: its answer ended (`expired`: its
        deadline ended it), or it was refused or rejected after `reserve`."""
        self.in_flight -= 1
        self._expired += expired

    def resumed(self) -> None:
        """An admitted stream moved to another attention rank."""
        self._resumed += 1

    def state(self) -> AdmissionState:
        """What `/afd/status` shows under `admission`."""
        return AdmissionState(
            in_flight=self.in_flight,
            capacity=self.capacity,
            admitted=self._admitted,
            refused_429=self._refused_429,
            refused_503=self._refused_503,
            expired=self._expired,
            resumed=self._resumed,
            last_refusal=self._last_refusal,
            load=self.load,
            load_age_s=time.monotonic() - self._load_time if self.load is not None else 0.0,
        )
