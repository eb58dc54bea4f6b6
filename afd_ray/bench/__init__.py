"""The CPU benchmark: plain vLLM against AFD topologies, under one fixed load.

`python -m afd_ray.bench` (also a Ray job entrypoint) serves a tiny MoE checkpoint as
plain vLLM (`afd_ray.bench.plain`, which says why this baseline is the fair one), then
as 1A:1F and 2A:2F AFD, one after another on one Ray Serve instance, `--repeats` times
in ABBA order; drives each with the same concurrent streaming load
(`afd_ray.bench.load`: output and decode tok/s, TPOT, TTFT); compares each AFD layout
with plain at the same batch, median and spread over the repeats
(`afd_ray.bench.compare`); and writes a `BenchResult` JSON (`afd_ray.bench.schema`,
with the commit it ran from) plus two tables. docs/benchmarks.md describes the counting. For AFD runs it puts the A2F/F2A bytes per
FFN step from `/afd/status` next to docs/models.md's AFD traffic per step, `2 × L × N_tokens × H × bytes_per_elem`.

This facade imports only the config and result models (pydantic), so reading a
result file does not import Ray or vLLM.
"""

from afd_ray.bench.config import BenchConfig, Topology
from afd_ray.bench.schema import BenchResult

__all__ = ["BenchConfig", "BenchResult", "Topology"]
