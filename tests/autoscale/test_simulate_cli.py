"""`afd-ray autoscale simulate`: decisions with reasons on stdout and a PNG plot, from
a synthetic ramp or a recorded trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_ray.autoscale.loader import load_policy
from afd_ray.autoscale.simulate import RampWorkload, simulate_ramp
from afd_ray.cli import main

POLICY = Path(__file__).parents[2] / "deployments" / "autoscale.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_simulate_ramp_prints_reasons_and_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "ramp.png"
    assert main(["autoscale", "simulate", "--policy", str(POLICY), "--ramp", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "attention +1 (1 -> 2): " in out and "attention -1 (2 -> 1): " in out
    assert "ffn +1 (1 -> 2): " in out and "ffn -1 (2 -> 1): " in out
    assert "4 changes; final A=1 F=1" in out
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 20_000


def test_simulate_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of snapshots (here from the ramp model) replays open loop: the same
    decisions as the closed loop made while the ranks followed them."""
    steps = simulate_ramp(RampWorkload(duration_s=300), load_policy(POLICY))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(s.snapshot.model_dump_json() + "\n" for s in steps))
    png = tmp_path / "trace.png"
    assert main(["autoscale", "simulate", "--policy", str(POLICY), "--trace", str(trace), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "t=  128.0s A=1 F=2" in out and "ffn +1 (1 -> 2): tokens_per_ffn_step" in out
    assert f"{len(steps)} evaluations" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_bad_trace_line_names_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"time_s": 0, "attention_ranks": 1, "ffn_ranks": 1}\n{"time_s": 1, "attention_ranks": 1}\n')
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "autoscale",
                "simulate",
                "--policy",
                str(POLICY),
                "--trace",
                str(trace),
                "--plot",
                str(tmp_path / "x.png"),
            ]
        )
    assert exit_.value.code == 1
    assert "trace.jsonl:2: ffn_ranks: Field required" in capsys.readouterr().err


def test_bad_policy_exits_1_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("attention:\n  scale_out_cooldown_s: -5\n")
    with pytest.raises(SystemExit) as exit_:
        main(["autoscale", "simulate", "--policy", str(policy), "--ramp", "--plot", str(tmp_path / "x.png")])
    assert exit_.value.code == 1
    assert "attention.scale_out_cooldown_s: Input should be greater than or equal to 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_an_output_that_cannot_be_written_is_named_before_the_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unwritable --out was found after the whole simulation; a folder as --plot
    likewise (new-user trial)."""
    for bad in ("/proc/nope/s.json", str(tmp_path)):
        with pytest.raises(SystemExit) as exit_:
            main(["autoscale", "simulate", "--policy", str(POLICY), "--ramp", flag, bad])
        assert exit_.value.code == 1
        err = capsys.readouterr()
        assert f"afd-ray: error: {flag}: {bad}" in err.err and "evaluations" not in err.out


@pytest.mark.parametrize(
    "argv",
    [
        ["autoscale", "record", "--out", "t.jsonl", "--duration-s", "5", "--interval-s", "0"],
        ["autoscale", "record", "--out", "t.jsonl", "--duration-s", "-5"],
        ["autoscale", "simulate", "--policy", str(POLICY), "--ramp", "--peak-rps", "-1"],
        ["scale", "--attention", "1", "--ffn", "1", "--timeout", "0"],
        ["autoscale", "record", "--out", "t.jsonl", "--duration-s", "5", "--interval-s", "inf"],
    ],
)
def test_non_positive_durations_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`record --interval-s 0` used to poll without end (a fresh user's report)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize(("pool", "count"), [("--attention", "0"), ("--ffn", "-1")])
def test_scale_to_no_ranks_is_a_usage_error(pool: str, count: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`scale --attention 0` (or a negative count) was sent to the server."""
    sizes = {"--attention": "1", "--ffn": "1"} | {pool: count}
    with pytest.raises(SystemExit) as exit_:
        main(["scale", *(item for pair in sizes.items() for item in pair), "--url", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    assert f"argument {pool}: must be >= 1, got {count}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["scale", "--attention", "1", "--ffn", "1"],
        ["autoscale", "apply", "--policy", str(POLICY)],
        ["trace", "some-id"],
    ],
    ids=["scale", "apply", "trace"],
)
@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1", "localhost:8000"])
def test_a_bad_url_is_a_usage_error(argv: list[str], url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--url 'http://[::1'` printed two chained tracebacks (httpx.InvalidURL is not an
    httpx.HTTPError; a fresh user's report)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--url", url])
    assert exit_.value.code == 2
    assert "argument --url:" in capsys.readouterr().err


def test_record_from_an_unreachable_url_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No traceback when nothing listens (a fresh user got httpx.ConnectError's)."""
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "autoscale",
                "record",
                "--url",
                "http://127.0.0.1:1",
                "--out",
                str(tmp_path / "t.jsonl"),
                "--duration-s",
                "1",
            ]
        )
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("afd-ray: error: http://127.0.0.1:1:")


def test_simulate_writes_its_json_and_the_png_next_to_it(tmp_path: Path) -> None:
    out = tmp_path / "ramp.json"
    argv = ["autoscale", "simulate", "--policy", str(POLICY), "--ramp", "--duration-s", "300", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert rows and {"snapshot", "decision"} <= set(rows[0])
    assert out.with_suffix(".png").stat().st_size > 0
