"""The benchmark's settings and summaries, without a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from afd_ray.bench import BenchConfig, Topology
from afd_ray.bench.cli import main
from afd_ray.bench.schema import Latency


def test_topologies_parse_from_their_labels() -> None:
    cfg = BenchConfig(topologies=("plain", "1A1F", "3a2f"))
    assert [(t.attention, t.ffn) for t in cfg.topologies] == [(1, 0), (1, 1), (3, 2)]
    assert [t.label for t in cfg.topologies] == ["plain", "1A1F", "3A2F"]
    assert Topology.model_validate(cfg.topologies[2].model_dump()) == cfg.topologies[2]


def test_bare_topology_runs_without_metrics_and_step_records() -> None:
    (bare,) = BenchConfig(topologies=("1a1f-bare",)).topologies
    assert (bare.attention, bare.ffn, bare.observability, bare.label) == (1, 1, False, "1A1F-bare")
    assert BenchConfig(topologies=("1A1F",)).topologies[0].observability


def test_dbo_topology_serves_two_ubatches_per_ffn_step(tmp_path: Path) -> None:
    from afd_ray.bench.runner import _app_config
    from afd_ray.models.shapes import build_shape

    cfg = BenchConfig(topologies=("2a1f-dbo", "2A1F-dbo-bare", "2A1F"), batch_window_us=3000)
    dbo, bare, lockstep = cfg.topologies
    assert (dbo.label, bare.label, lockstep.label) == ("2A1F-dbo", "2A1F-dbo-bare", "2A1F")
    assert (dbo.ubatches, bare.ubatches, bare.observability, lockstep.ubatches) == (2, 2, False, 1)
    app = _app_config(cfg, "deepseek-v2-lite", build_shape("deepseek-v2-lite", tmp_path / "shape"), dbo)
    assert (app.ffn.ubatches, app.connector.batch_window_us) == (2, 3000)


def test_afd_topologies_run_the_default_graph_mode_unless_piecewise_is_named(tmp_path: Path) -> None:
    from afd_ray.bench.runner import _app_config
    from afd_ray.models.shapes import build_shape

    cfg = BenchConfig(platform="cuda", topologies=("1A1F", "1a1f-full", "1A1F-piecewise"), transport="cuda_ipc")
    default, full, piecewise = cfg.topologies
    assert [t.label for t in cfg.topologies] == ["1A1F", "1A1F", "1A1F-piecewise"]
    assert (default.cudagraph_mode, full.cudagraph_mode, piecewise.cudagraph_mode) == (
        "full_decode",
        "full_decode",
        "piecewise",
    )
    checkpoint = build_shape("deepseek-v2-lite", tmp_path / "shape")
    assert _app_config(cfg, "deepseek-v2-lite", checkpoint, default).attention.cudagraph_mode == "full_decode"
    assert _app_config(cfg, "deepseek-v2-lite", checkpoint, piecewise).attention.cudagraph_mode == "piecewise"


@pytest.mark.parametrize("label", ["1A1F-dbo", "3A2F-dbo", "1A2F-dbo-bare"])
def test_dbo_with_fewer_than_two_attention_ranks_per_ffn_rank_is_rejected(label: str) -> None:
    """`1A1F-dbo` was accepted and ran exactly as `1A1F`: one peer is one ubatch."""
    with pytest.raises(
        ValidationError, match=rf"topology '{label}': -dbo needs at least 2 attention ranks per FFN rank"
    ):
        BenchConfig(topologies=(label,))
    assert Topology.model_validate("4a2f-dbo").ubatches == 2


@pytest.mark.parametrize(
    "label",
    [
        "1A0F",
        "AF",
        "2x2",
        "",
        "plain-bare",
        "1A1F-off",
        "1A1F-bare-dbo",
        "plain-dbo",
        "1A1F-full-bare",
        "plain-full",
        "1A1F-full-piecewise",
    ],
)
def test_bad_topology_is_rejected_with_its_label(label: str) -> None:
    with pytest.raises(ValidationError, match="topolog"):
        BenchConfig(topologies=(label,))


@pytest.mark.parametrize(
    ("label", "message"),
    [
        # said only "Input should be greater than or equal to 1 (got 0)"
        ("0A1F", "topology '0A1F': attention ranks A must be from 1 to 256, got 0"),
        ("1A0F", "topology '1A0F': FFN ranks F must be from 1 to 256, got 0"),
        ("1A257F-dbo", "topology '1A257F-dbo': FFN ranks F must be from 1 to 256, got 257"),
    ],
)
def test_a_rank_count_out_of_bounds_names_the_pool_and_the_bound(
    label: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--topologies", label])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m afd_ray.bench: error: --topologies: {message}"


def test_bad_topology_flag_is_one_line_naming_the_flag_and_the_form(capsys: pytest.CaptureFixture[str]) -> None:
    """A label that does not parse printed pydantic's two errors (the label, then
    the emptied list's length) with their URLs."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--topologies", "1x1F"])
    assert exit_info.value.code == 2
    (message,) = capsys.readouterr().err.splitlines()[-1:]
    assert message == (
        "python -m afd_ray.bench: error: --topologies: topology '1x1F': expected 'plain' or "
        "'<A>A<F>F[-dbo][-bare][-full|-piecewise]' with F >= 1 (e.g. 2A2F, 2A1F-dbo, 1A1F-bare, 1A1F-piecewise)"
    )


def test_bad_flag_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--concurrency", "0"])
    assert exit_info.value.code == 2
    assert "concurrency" in capsys.readouterr().err


def test_unwritable_out_exits_2_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """It was found after the whole run, as a traceback (new-user trial)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--out", "/proc/nope/result.json"])
    assert exit_info.value.code == 2
    assert "error: --out: /proc/nope/result.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        # cuda_ipc on CPU was accepted; the run failed once Ray was up, in the app's config
        (["--transport", "cuda_ipc"], "['gloo', 'shm']"),
        (["--platform", "cuda", "--transport", "shm"], "['cuda_ipc', 'nccl']"),
    ],
)
def test_a_transport_the_platform_cannot_use_exits_2_naming_the_flag(
    argv: list[str], allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    transport = argv[-1]
    with pytest.raises(ValidationError, match="transport"):  # before main(), which would start Ray if accepted
        BenchConfig(platform="cuda" if transport == "shm" else "cpu", transport=transport)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            f"--transport: {transport!r} cannot carry {'gloo' if transport == 'cuda_ipc' else 'nccl'} tensors; "
            f"use auto or one of {allowed}"
        )
    )
    assert BenchConfig(platform="cuda", transport="cuda_ipc").transport == "cuda_ipc"


def test_batch_window_over_its_bound_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--batch-window-us", "3000000"])
    assert exit_info.value.code == 2
    assert "--batch-window-us: Input should be less than or equal to 100000 (got 3000000)" in capsys.readouterr().err


def test_prompt_and_output_over_the_context_exit_2_before_any_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    """`--prompt-tokens 4096` with the default context of 512 was found only by the
    engine, request by request, after the first layout was deployed."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt-tokens", "4096"])
    assert exit_info.value.code == 2
    assert "prompt_tokens: 4096 + max_tokens 64 > max_model_len 512" in capsys.readouterr().err
    assert BenchConfig(prompt_tokens=448, max_tokens=64).max_model_len == 512


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"concurrency": "4"}, "concurrency"),
        ({"concurrency": ["4"]}, "concurrency.0"),
        ({"concurrency": (4.0,)}, "concurrency.0"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"seed": "3"}, "seed"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"slo_tpot_ms": float("inf")}, "slo_tpot_ms"),
        ({"topologies": [{"attention": "2", "ffn": 1}]}, "topologies.0.attention"),
        ({"concurency": (4,)}, "concurency"),
    ],
)
def test_python_callers_get_the_strict_checks_of_the_config_tree(settings: dict[str, object], field: str) -> None:
    """A notebook's `BenchConfig(concurrency=["4"])` was coerced to 4 (and `"4"`,
    `8.0`, `"yes"`, an infinite SLO likewise accepted)."""
    with pytest.raises(ValidationError) as error:
        BenchConfig.model_validate(settings)
    assert ".".join(map(str, error.value.errors()[0]["loc"])) == field


def test_lists_and_path_strings_stay_accepted() -> None:
    cfg = BenchConfig(
        concurrency=[4, 8], families=["llama"], topologies=["1A1F"], checkpoints="/tmp/tiny", kv_cache_gib=1
    )
    assert (cfg.concurrency, cfg.families, cfg.kv_cache_gib) == ((4, 8), ("llama",), 1.0)
    assert cfg.checkpoints == Path("/tmp/tiny")


def test_latency_summary_in_milliseconds() -> None:
    summary = Latency.of([0.010, 0.020, 0.030])
    assert summary.count == 3
    assert summary.mean_ms == pytest.approx(20.0) and summary.p50_ms == pytest.approx(20.0)
    assert Latency.of([0.005]).p99_ms == pytest.approx(5.0)  # one sample: its own percentiles


def test_several_batches_and_cuda_settings_parse_from_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_ray.bench.cli import RUN_FLAGS, build_parser

    args = vars(
        build_parser().parse_args(
            [
                "--platform",
                "cuda",
                "--dtype",
                "bfloat16",
                "--families",
                "deepseek-v2-lite",
                "--concurrency",
                "16",
                "64",
                "--prompt-tokens",
                "4096",
                "--max-model-len",
                "4352",
                "--gpu-fraction",
                "0.5",
                "--no-enforce-eager",
            ]
        )
    )
    cfg = BenchConfig.model_validate({k: v for k, v in args.items() if k not in RUN_FLAGS})
    assert (cfg.platform, cfg.dtype, cfg.families, cfg.concurrency) == (
        "cuda",
        "bfloat16",
        ("deepseek-v2-lite",),
        (16, 64),
    )
    assert (cfg.prompt_tokens, cfg.gpu_fraction, cfg.enforce_eager) == (4096, 0.5, False)
    with pytest.raises(ValidationError, match="concurrency"):
        BenchConfig(concurrency=())


@pytest.mark.parametrize("topology", ["plain", "1A1F", "2A1F"])
def test_app_config_admits_the_largest_batch(topology: str, tmp_path: Path) -> None:
    """The product benchmark's batches (16-256 streams on one attention rank) build a
    valid app config: the ingress holds more than the admission capacity (failed on the
    H200 at batch 256: 256 ongoing requests < 1 x (256 + 16))."""
    from afd_ray.bench.runner import _app_config
    from afd_ray.models.shapes import build_shape

    cfg = BenchConfig(platform="cuda", topologies=(topology,), concurrency=(16, 64, 256), transport="cuda_ipc")
    checkpoint = build_shape("deepseek-v2-lite", tmp_path / "deepseek-v2-lite")
    app = _app_config(cfg, "deepseek-v2-lite", checkpoint, cfg.topologies[0])
    assert app.attention.max_num_seqs == 256
    capacity = app.attention.upper * (256 + app.ingress.max_queued_per_rank)
    assert app.ingress.max_ongoing_requests > capacity


def test_fp8_runs_both_sides_quantized_on_cuda_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--quantization fp8` (issue 35's FP8 product benchmark) sets `model.quantization`
    of the plain and the AFD app alike; on CPU it exits 2 before any deployment."""
    from afd_ray.bench.runner import _app_config
    from afd_ray.models.shapes import build_shape

    cfg = BenchConfig(platform="cuda", quantization="fp8", topologies=("plain", "1A1F"), transport="cuda_ipc")
    checkpoint = build_shape("deepseek-v2-lite", tmp_path / "shape")
    for topology in cfg.topologies:
        assert _app_config(cfg, "deepseek-v2-lite", checkpoint, topology).model.quantization == "fp8"
    with pytest.raises(SystemExit) as exit_info:
        main(["--quantization", "fp8"])
    assert exit_info.value.code == 2
    assert "quantization: fp8 needs platform cuda" in capsys.readouterr().err


def test_a_device_trace_past_the_rounds_end_exits_2_before_any_deployment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--smoke --device-trace-steps 4` (4 tokens x 1 request per stream) ran 7 minutes
    and then lost its AFD round: the trace starts only after 16 steps (new-user trial)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--device-trace-steps", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "device_trace_steps: 4 steps traced after the first 16" in err and "requests_per_stream 1" in err
    assert BenchConfig(max_tokens=16, requests_per_stream=2, device_trace_steps=4).device_trace_steps == 4
