"""The attention side's signal source: a vLLM stat logger that keeps what the
autoscaling policy needs from vLLM's own per-step stats.

vLLM's `AsyncLLM` calls every stat logger's `record` from its output handler (in the
attention replica's event loop) with the engine's `SchedulerStats` (KV-cache usage,
waiting and running requests) and `IterationStats` (TTFT of requests that got their
first token, finished requests with their time per output token). The attention
server passes `recorder.factory` in `AsyncLLM.from_engine_args(stat_loggers=...)` and
sends `recorder.drain()` to the coordinator periodically.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from afd_ray.observability.signals import AttentionReport

__all__ = ["AttentionRecorder"]


class AttentionRecorder(StatLoggerBase):
    """Collects one engine's TTFT/TPOT samples and its latest scheduler gauges.

    vLLM marks `StatLoggerBase` and the stats classes as unstable interfaces; this is
    written against vLLM 0.32 (`vllm/v1/metrics/loggers.py`, `stats.py`).
    """

    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0) -> None:
        self._ttft_s: list[float] = []
        self._tpot_s: list[float] = []
        self._generation_tokens = 0
        self._kv_cache_usage = 0.0
        self._waiting = 0
        self._running = 0

    def factory(self, vllm_config: VllmConfig, engine_index: int) -> AttentionRecorder:
        """A vLLM `PerEngineStatLoggerFactory` that hands vLLM this recorder."""
        return self

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        """Keep the gauges of `scheduler_stats` and the samples of `iteration_stats`.

        TPOT is vLLM's `FinishedRequestStats.mean_time_per_output_token` (decode time
        / (output tokens - 1)), kept for requests with at least two output tokens.
        Waiting counts vLLM's deferred waiting requests too.
        """
        if scheduler_stats is not None:
            self._kv_cache_usage = min(max(scheduler_stats.kv_cache_usage, 0.0), 1.0)
            self._waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self._running = scheduler_stats.num_running_reqs
        if iteration_stats is not None:
            self._ttft_s.extend(iteration_stats.time_to_first_tokens_iter)
            self._tpot_s.extend(
                finished.mean_time_per_output_token
                for finished in iteration_stats.finished_requests
                if finished.num_generation_tokens > 1
            )
            self._generation_tokens += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        """Nothing to log (required by `StatLoggerBase`)."""

    def drain(self, unfinished_requests: int) -> AttentionReport:
        """The samples since the previous `drain` and the latest gauges; forgets the
        samples.

        vLLM sends scheduler stats only while the engine steps, so the last gauges
        outlive the last request; with `unfinished_requests` (`AsyncLLM.
        get_num_unfinished_requests()`) at 0 the engine is idle and the gauges are 0.
        """
        idle = unfinished_requests == 0
        report = AttentionReport(
            ttft_s=self._ttft_s,
            tpot_s=self._tpot_s,
            generation_tokens=self._generation_tokens,
            kv_cache_usage=0.0 if idle else self._kv_cache_usage,
            waiting_requests=0 if idle else self._waiting,
            running_requests=0 if idle else self._running,
        )
        self._ttft_s, self._tpot_s, self._generation_tokens = [], [], 0
        return report
