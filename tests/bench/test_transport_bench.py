"""The transport microbenchmark runs through the connector contract in two processes
and reports every CPU transport (a few steps only: this checks the harness and the
bytes, not the speed)."""

from __future__ import annotations

from afd_ray.bench.schema import TransportResult
from afd_ray.bench.transport import format_table, run


def test_microbenchmark_reports_each_cpu_transport() -> None:
    result = TransportResult.model_validate(run(token_counts=(1, 16), layers=3, steps=2))
    assert set(result.roundtrip_us_per_layer) == {"shm", "gloo"}
    for row in result.roundtrip_us_per_layer.values():
        assert set(row) == {"1", "16"} and all(us > 0 for us in row.values())
    assert "| shm |" in format_table(result.model_dump())
