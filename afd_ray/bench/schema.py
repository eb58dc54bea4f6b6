"""The result JSON of `python -m afd_ray.bench`: `BenchResult` and its parts.

Times are milliseconds (`*_ms`) or seconds (`*_s`), sizes bytes. `BenchResult` is the
whole file; read one back with `BenchResult.model_validate_json(text)`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from afd_ray.bench.config import BenchConfig, Topology
from afd_ray.bench.slo import SLOResult

__all__ = [
    "SCHEMA_VERSION",
    "BenchResult",
    "FFNRankResult",
    "Latency",
    "Figures",
    "Machine",
    "RunResult",
    "SameBatch",
    "Stat",
    "StepSplitResult",
    "TransportResult",
]

SCHEMA_VERSION = 3
"""Bumped whenever a field changes meaning or is removed (2: `config.concurrency` is
a tuple, one run per value, `RunResult.concurrency`; `Machine.gpu`. 3: `config.repeats`,
one run per layout, batch and repeat, `RunResult.repeat`; `RunResult.decode_tokens_per_s`;
`BenchResult.commit` and `same_batch`)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Latency(_Record):
    """Mean and percentiles of one latency figure over a run, milliseconds."""

    count: int
    """Samples the figures summarize."""
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, samples_s: Sequence[float]) -> Latency:
        """Summarize `samples_s` (seconds, at least one) with `statistics`
        (inclusive percentiles; a single sample is its own percentiles)."""
        ms = [s * 1e3 for s in samples_s]
        cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
        return cls(count=len(ms), mean_ms=statistics.fmean(ms), p50_ms=cuts[49], p90_ms=cuts[89], p99_ms=cuts[98])


class Machine(_Record):
    """Where the numbers were measured."""

    cpu_model: str
    """`model name` of /proc/cpuinfo."""
    logical_cores: int
    """Logical CPUs of the machine (`os.cpu_count()`)."""
    usable_cores: int
    """Logical CPUs this process may run on (its affinity mask)."""
    memory_gib: float
    """MemTotal of /proc/meminfo, GiB."""
    os: str
    python: str
    torch: str
    vllm: str
    ray: str
    gpu: str | None = None
    """Name of CUDA device 0 (`torch.cuda.get_device_name`) on a `cuda` run; None on CPU."""


class StepSplitResult(_Record):
    """One FFN rank's step split over the load (`afd_ray.observability.timeline`): the
    interval from one FFN step's last F2A to the next one's, on the FFN rank's device
    timeline (CUDA events of its stream; host time on CPU), as means per timed step,
    milliseconds, and as fractions of `step_ms` (they add up to 1)."""

    timed_steps: int
    """Steps timed during the load (every step on CPU, one in
    `timeline.CUDA_SAMPLE_EVERY` on CUDA; not a step starting over `timeline.IDLE_GAP_S` after the
    previous one, like the first of the load)."""
    step_ms: float
    """Mean interval: the sum of the four parts."""
    attention_ms: float
    """Waits for each later layer's rows: the attention rank's per-layer work and the
    A2F transfer."""
    wire_ms: float
    """F2A copies and signals queued on the FFN rank."""
    ffn_ms: float
    """FFN compute, EP collectives included."""
    idle_ms: float
    """Previous step's last F2A to the first layer's rows: the attention rank's work
    before layer 0, sampling, scheduling, host gaps."""
    attention_fraction: float
    wire_fraction: float
    ffn_fraction: float
    idle_fraction: float


class FFNRankResult(_Record):
    """One FFN rank over the measured load: counter deltas of `/afd/status`."""

    rank: int
    steps: int
    """FFN steps served during the load."""
    tokens: int
    """Token rows served during the load, summed over steps."""
    mean_tokens_per_step: float
    """`tokens / steps`: N_tokens of the traffic formula."""
    a2f_bytes_per_step: float
    """Hidden-state bytes received from attention peers per step (all layers)."""
    f2a_bytes_per_step: float
    """FFN-output bytes sent back per step (all layers)."""
    formula_bytes_per_step: float
    """The AFD traffic per step of docs/models.md, `2 × L × N_tokens × H × bytes_per_elem`, with L and H from the
    checkpoint config and N_tokens = `mean_tokens_per_step`."""
    busy_fraction: float
    """Time inside steps (receive + compute + send) over the load's wall time (host
    time: on CUDA the launches, not the device work)."""
    compute_ms_per_step: float = 0.0
    """The rank's own FFN compute per step, EP collectives left out, milliseconds
    (`FFNMember.compute_s`; host time: on CUDA the launches). With EP, the rank with
    the largest is the straggler the others wait for (issue 34)."""
    ep_ms_per_step: float = 0.0
    """EP collectives per step, milliseconds (`FFNMember.ep_s`): mostly the wait for
    the slowest rank."""
    split: StepSplitResult | None = None
    """The step split of the load; None when no step of it was timed."""


class RunResult(_Record):
    """One family served with one topology under the fixed load."""

    family: str
    topology: Topology
    label: str
    """`Topology.label`: `plain` or `<A>A<F>F`, with `-dbo` (two FFN ubatches), `-bare`
    (no metrics or step records) and `-piecewise` (piecewise attention graphs instead of
    the default whole decode steps)."""
    concurrency: int
    """Concurrent request streams of this load (one value of `config.concurrency`)."""
    repeat: int = 0
    """Which deployment of the layout measured it, from 0 to `config.repeats - 1`."""
    layers: int | None = None
    """Decoder layers of the checkpoint: A2F/F2A exchanges per AFD step. None in
    results written before it was recorded."""
    threads: int
    """Torch threads of all pool members together (engines + FFN ranks)."""
    deploy_s: float
    """`serve.run` until the application was ready, seconds."""
    requests: int
    output_tokens: int
    """Output tokens of all measured requests (from each stream's final usage)."""
    prompt_tokens: int
    """Prompt tokens of one request."""
    wall_s: float
    """First request sent until the last one finished, seconds (at least `config.min_round_s`)."""
    output_tokens_per_s: float
    """`output_tokens / wall_s`: time to first token included."""
    decode_tokens_per_s: float | None = None
    """Decode rate, tokens/s: the batch times the tokens after the first over the time
    after the first token, summed over the requests,
    `concurrency x sum_r (n_r - 1) / sum_r (t_last,r - t_first,r)`
    (`afd_ray.bench.load.LoadResult.decode_tokens_per_s`; requests delivered in one
    chunk left out): the batch over the token-weighted mean TPOT. None in results
    written before it was recorded (schema 2)."""
    ttft: Latency
    """Time to first token of each request."""
    tpot: Latency
    """Mean time per output token of each request after its first:
    `(last token - first token) / (output tokens - 1)`."""
    itl: Latency
    """Gaps between consecutive token-carrying stream chunks, all requests."""
    e2e: Latency
    """Request sent until its stream ended."""
    load_average_1m: tuple[float, float]
    """The machine's 1-minute load average before and after the load (how much else
    was running)."""
    ffn: list[FFNRankResult]
    """Per FFN rank, in rank order; empty for plain vLLM."""
    measured_bytes_per_step: float | None
    """A2F + F2A bytes per step summed over FFN ranks; None for plain vLLM."""
    formula_bytes_per_step: float | None
    """`formula_bytes_per_step` summed over FFN ranks; None for plain vLLM."""
    slo: SLOResult | None = None
    """SLO-goodput and cost per 1M output tokens, for the config's SLOs and price;
    None in results written before it was recorded (e.g. benchmarks/results/ of
    2026-12-01), which still load."""


class Stat(_Record):
    """Median and range of one figure over the repeats."""

    median: float
    """`statistics.median` (the mean of the middle two for an even count)."""
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        """Summarize `values` (at least one)."""
        return cls(median=statistics.median(values), min=min(values), max=max(values))


class Figures(_Record):
    """The figures compared batch against batch, each over the repeats: of one side,
    or the AFD/plain ratio of each repeat's pair (then every field is a ratio)."""

    output_tok_s: Stat
    """`RunResult.output_tokens_per_s` (time to first token included)."""
    decode_tok_s: Stat
    """`RunResult.decode_tokens_per_s`."""
    tpot_p50_ms: Stat
    """`RunResult.tpot.p50_ms`."""
    tpot_p90_ms: Stat
    """`RunResult.tpot.p90_ms`."""
    ttft_p50_ms: Stat
    """`RunResult.ttft.p50_ms`."""


class SameBatch(_Record):
    """One AFD layout against plain vLLM at one batch, same batch against same batch
    (`afd_ray.bench.compare`)."""

    family: str
    layout: str
    """The AFD layout's `Topology.label`."""
    batch: int
    """Concurrent streams (`RunResult.concurrency`) of both sides."""
    repeats: int
    """Pairs compared: repeat k of the AFD layout with repeat k of plain."""
    plain: Figures
    afd: Figures
    ratio: Figures
    """AFD / plain of each pair, then median and range over the pairs (the median of
    the paired ratios, not the ratio of the medians: a pair ran back to back, so a
    drift of the machine between repeats cancels within it)."""


class TransportResult(_Record):
    """The transport microbenchmark (`afd_ray.bench.transport`)."""

    roundtrip_us_per_layer: dict[str, dict[str, float]]
    """Transport -> token count T (as a string) -> median A2F+F2A round trip per
    layer, microseconds."""
    attention_cpu_us_per_layer: dict[str, dict[str, float]]
    """Same keys: CPU time of the attention process per layer, microseconds (the
    rest of the round trip is waiting on the FFN process and wake-ups)."""
    hidden_size: int
    dtype: str
    layers_per_step: int
    steps: int
    threads_per_side: int
    compute: bool
    """Whole layers with SmolLM2-sized compute on both sides, not bare round trips."""
    omp_wait_policy: str
    """`OMP_WAIT_POLICY` of both processes ("" when unset)."""
    cpu: str
    cores: int
    load_average_at_start: float
    """1-minute load average when the microbenchmark started (other work on the cores)."""


class BenchResult(_Record):
    """The whole result file."""

    schema_version: int = SCHEMA_VERSION
    created: str
    """UTC time the run finished, ISO 8601."""
    commit: str | None = None
    """Git commit of the code that ran (`--commit`, else `git rev-parse HEAD` with
    `-dirty` for uncommitted changes to tracked files); None where neither was known."""
    machine: Machine
    config: BenchConfig
    runs: list[RunResult]
    """One per family, layout, repeat and batch, in the order measured."""
    same_batch: list[SameBatch] = []
    """Every AFD layout against plain vLLM, per family and batch; empty without plain runs."""
    transport: TransportResult | None = None
    """Round trip per layer of each CPU transport, measured before the runs."""
