"""`afd-ray check FILE.yaml`: every error of a config file with its key path, exit
status 1 on an error; the pools against a running Ray cluster only where one runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from afd_ray.cli import main
from afd_ray.config import AFDConfig
from afd_ray.serve.check import ClusterResources, args_errors, cluster_errors, fp8_device_errors

ROOT = Path(__file__).parents[1]
SHIPPED = sorted((ROOT / "deployments").glob("*.yaml"))
APP = "applications[0].args"


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths in the files (`autoscale.policy`) are read from the repository
    root, where `serve run deployments/afd.yaml` runs."""
    monkeypatch.chdir(ROOT)


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(["check", *argv])
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _app_file(tmp_path: Path, **sections: dict[str, object]) -> Path:
    """deployments/afd.yaml with `sections` merged into its application's args."""
    data = yaml.safe_load((ROOT / "deployments" / "afd.yaml").read_text())
    args = data["applications"][0]["args"]
    for name, values in sections.items():
        args[name] = {**args.get(name, {}), **values}
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_yaml_passes(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CUDA file too: the file is checked, not this machine."""
    status, out, err = _check(capsys, str(path), "--offline")
    assert status == 0, err
    assert out == f"{path}: OK (1 checked; pools not checked: --offline)\n"


def test_every_error_is_printed_with_its_key_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _app_file(tmp_path, attention={"num_ranks": 0, "engine_args": {"enable_prefix_cachin": True}})
    status, out, err = _check(capsys, str(path), "--offline")
    assert status == 1 and out == ""
    lines = err.splitlines()
    assert f"{path}: {APP}.attention.num_ranks: Input should be greater than or equal to 1" in lines
    unknown = f"{path}: {APP}.attention.engine_args.enable_prefix_cachin: 'enable_prefix_cachin' is not an engine"
    assert any(line.startswith(unknown) and "did you mean 'enable_prefix_caching'?" in line for line in lines), err
    assert lines[-1] == f"afd-ray: error: {path}: 2 errors"


def test_an_owned_engine_arg_names_the_afd_ray_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _app_file(tmp_path, attention={"engine_args": {"max_model_len": 4096}})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    assert f"{APP}.attention.engine_args.max_model_len: 'max_model_len' is owned by afd_ray" in err
    assert "set model.max_model_len instead" in err


def test_a_cross_section_error_is_put_under_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _app_file(tmp_path, model={"quantization": "fp8"})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    assert f"{path}: {APP}.model.quantization: fp8 needs FP8 kernels" in err


@pytest.mark.parametrize(
    ("sections", "error"),
    [
        (
            {"ffn": {"num_ranks": 3, "max_ranks": 3, "bundle_resources": 4}},
            f"{APP}.ffn: num_ranks 3 x 4 CPU = 12 CPU, the running Ray cluster has 8",
        ),
        (
            {"attention": {"bundle_resources": 5}, "ffn": {"bundle_resources": 5}},
            f"{APP}: attention + ffn at start need 10 CPU, the running Ray cluster has 8",
        ),
    ],
    ids=["one-pool", "both-pools"],
)
def test_pools_are_checked_against_the_running_cluster(
    ray_cluster: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    sections: dict[str, dict[str, object]],
    error: str,
) -> None:
    """The session cluster has 8 CPUs; the same file passes `--offline`."""
    path = _app_file(tmp_path, **sections)
    status, _, err = _check(capsys, str(path))
    assert status == 1
    assert f"{path}: {error}\n" in err
    assert _check(capsys, str(path), "--offline")[0] == 0
    fits = ROOT / "deployments" / "afd.yaml"
    assert _check(capsys, str(fits))[1] == f"{fits}: OK (1 checked; pools checked against this process's Ray cluster)\n"


def test_ffn_standby_ranks_are_counted_against_the_cluster() -> None:
    """The FFN deployment runs `num_ranks + standby_ranks` replicas, one bundle each:
    2 + 1 FFN bundles of 2 CPU and 1 attention bundle of 1 CPU need 6 + 1 CPU. Before,
    the standby was not counted (4 + 1 CPU passed on 5 and 6, then a replica never
    started)."""
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": 2, "max_ranks": 2, "standby_ranks": 1, "bundle_resources": 2}})

    def errors(cpus: float) -> list[str]:
        cluster = ClusterResources(total={"CPU": cpus}, largest_node={"CPU": cpus})
        return [str(e) for e in cluster_errors(cfg, cluster, prefix="")]

    assert errors(5) == ["ffn: num_ranks 2 + standby_ranks 1 = 3 x 2 CPU = 6 CPU, the running Ray cluster has 5"]
    assert errors(6) == ["<root>: attention + ffn at start need 7 CPU, the running Ray cluster has 6"]
    assert errors(7) == []


def test_fp8_is_refused_on_gpus_without_fp8_kernels() -> None:
    """From the nodes' `accelerator_type:` resources, as Ray names the GPU."""
    cfg = AFDConfig.model_validate({"platform": "cuda", "model": {"quantization": "fp8"}})

    def cluster(gpu: str) -> ClusterResources:
        resources = {"CPU": 64.0, "GPU": 8.0, f"accelerator_type:{gpu}": 1.0}
        return ClusterResources(total=resources, largest_node=resources)

    (error,) = fp8_device_errors(cfg, cluster("A100"), prefix="")
    assert (
        str(error)
        == "model.quantization: fp8 needs GPUs of compute capability >= 8.9; the running Ray cluster has A100"
    )
    assert fp8_device_errors(cfg, cluster("H100"), prefix="") == []
    assert fp8_device_errors(AFDConfig.model_validate({"platform": "cuda"}), cluster("A100")) == []


def test_a_value_error_beside_an_unknown_and_an_owned_key_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a fresh-user trial: the wrong-type `seed` was dropped when an unknown
    key sat beside it (the key check failed first and the value check never ran)."""
    engine = {"seed": "7", "enable_prefix_cachin": True, "max_model_len": 4096, "block_size": "16"}
    path = _app_file(tmp_path, attention={"engine_args": engine})
    status, out, err = _check(capsys, str(path), "--offline")
    assert status == 1 and out == ""
    lines = err.splitlines()
    where = f"{path}: {APP}.attention.engine_args"
    for start in (
        f"{where}.seed: '7' does not fit vLLM's type",
        f"{where}.block_size: '16' does not fit vLLM's type",
        f"{where}.enable_prefix_cachin: 'enable_prefix_cachin' is not an engine argument",
        f"{where}.max_model_len: 'max_model_len' is owned by afd_ray",
    ):
        assert sum(line.startswith(start) for line in lines) == 1, (start, err)
    assert lines[-1] == f"afd-ray: error: {path}: 4 errors"


def _bad_policy(tmp_path: Path) -> Path:
    """deployments/autoscale.yaml with two bad fields, one in each pool."""
    policy = yaml.safe_load((ROOT / "deployments" / "autoscale.yaml").read_text())
    policy["attention"]["scale_in_cooldown_s"] = -1
    policy["ffn"]["step"] = 0
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def test_policy_errors_are_printed_one_per_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a fresh-user trial: a policy's errors came joined on one line."""
    policy = _bad_policy(tmp_path)
    status, _, err = _check(capsys, str(policy), "--offline")
    assert status == 1
    lines = err.splitlines()
    assert f"{policy}: attention.scale_in_cooldown_s: Input should be greater than or equal to 0" in lines, err
    assert f"{policy}: ffn.step: Input should be greater than or equal to 1" in lines, err
    assert lines[-1] == f"afd-ray: error: {policy}: 2 errors"

    app = _app_file(tmp_path, autoscale={"policy": str(policy)})
    status, _, err = _check(capsys, str(app), "--offline")
    assert status == 1
    lines = err.splitlines()
    where = f"{app}: {APP}.autoscale.policy: {policy}"
    assert f"{where}: attention.scale_in_cooldown_s: Input should be greater than or equal to 0" in lines, err
    assert f"{where}: ffn.step: Input should be greater than or equal to 1" in lines, err
    assert lines[-1] == f"afd-ray: error: {app}: 2 errors"


def _checkpoint_folder(tmp_path: Path, quantized: dict[str, object]) -> Path:
    """A folder with a Qwen3-MoE config.json carrying `quantized` as its `quantization_config`."""
    folder = tmp_path / f"{quantized['quant_method']}-checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": quantized}))
    return folder


def test_an_fp8_checkpoint_passes_on_cuda_and_is_refused_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FP8 checkpoints are served (both roles read their scales); they need FP8 kernels."""
    quantized = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    folder = _checkpoint_folder(tmp_path, quantized)
    path = _app_file(tmp_path, model={"source": str(folder)})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    assert f"{path}: {APP}.model.source: '{folder}' is an FP8 checkpoint and needs FP8 kernels" in err, err
    data = yaml.safe_load(path.read_text())
    data["applications"][0]["args"]["platform"] = "cuda"
    path.write_text(yaml.safe_dump(data))
    assert _check(capsys, str(path), "--offline")[0] == 0
    cfg = AFDConfig.model_validate(data["applications"][0]["args"])
    resources = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:A100": 1.0}
    (error,) = fp8_device_errors(cfg, ClusterResources(total=resources, largest_node=resources), prefix="")
    assert str(error).startswith("model.source: an FP8 checkpoint needs GPUs of compute capability >= 8.9")


def test_another_quantized_checkpoint_is_refused_naming_the_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _checkpoint_folder(tmp_path, {"quant_method": "awq", "bits": 4})
    path = _app_file(tmp_path, model={"source": str(folder)})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    assert (
        f"{path}: {APP}.model.source: '{folder}' is a quantized checkpoint (config.json quantization_config, "
        "quant_method 'awq'); afd_ray serves FP8 checkpoints (quant_method 'fp8') only" in err
    ), err


def test_cross_field_errors_come_with_the_field_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, pydantic's cross-field checks ran only once every field validated, so a
    file needed one `check` per kind of error. A cross-field error about a key that
    failed (the attention pool's bounds, from num_ranks 0) is not reported."""
    path = _app_file(
        tmp_path,
        attention={"num_ranks": 0},
        ffn={"ubatches": 64, "eplb": {"enabled": True}},
        ingress={"max_ongoing_requests": 1},
    )
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    lines = err.splitlines()
    assert lines[:-1] == [
        f"{path}: {APP}.attention.num_ranks: Input should be greater than or equal to 1",
        f"{path}: {APP}.ffn.ubatches: Input should be less than or equal to 8",
        f"{path}: {APP}.ingress.max_ongoing_requests: 1 must exceed the admission capacity 64 (attention.max_ranks "
        "x (attention.max_num_seqs + ingress.max_queued_per_rank))",
        f"{path}: {APP}.ffn.eplb.enabled: true balances the experts of MoE layers; model.source 'smollm2' is dense "
        "(no MoE layer): leave ffn.eplb off",
    ], err
    assert lines[-1] == f"afd-ray: error: {path}: 4 errors"


def test_skipped_cross_field_checks_are_said() -> None:
    """A cross-section error on a key the file leaves at its default cannot be dropped,
    so the checks after it do not run: the output says so."""
    cfg, errors = args_errors({"attention": {"max_num_seqs": 1000}}, "args")
    assert cfg is None
    assert [e.path for e in errors] == ["args.ingress.max_ongoing_requests", "args"]
    assert errors[1].message.startswith("cross-field checks were skipped because of the errors above")


@pytest.mark.parametrize(
    ("eplb", "source", "error"),
    [
        ({"num_redundant_experts": 2}, "smollm2", "ffn.eplb.num_redundant_experts: 2 balances the experts"),
        ({"enabled": True}, "smollm2-moe", None),
    ],
    ids=["dense", "moe"],
)
def test_eplb_needs_an_moe_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], eplb: dict[str, object], source: str, error: str | None
) -> None:
    path = _app_file(tmp_path, model={"source": source}, ffn={"min_ranks": 2, "num_ranks": 2, "eplb": eplb})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == (1 if error else 0), err
    assert error is None or f"{path}: {APP}.{error}" in err


def test_unknown_keys_of_the_serve_file_name_the_nearest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ray Serve's schema lets unknown keys pass (`aplications:` was read as a policy
    file, an application's `rute_prefix` was ignored)."""
    text = (ROOT / "deployments" / "afd.yaml").read_text()
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(text.replace("applications:", "aplications:"))
    status, _, err = _check(capsys, str(misspelt), "--offline")
    assert status == 1
    assert f"{misspelt}: aplications: unknown key; did you mean 'applications'?" in err.splitlines(), err
    data = yaml.safe_load(text)
    data["applications"][0]["rute_prefix"] = "/v1"
    data["http_optons"] = {"port": 8000}
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump(data))
    status, _, err = _check(capsys, str(extra), "--offline")
    assert status == 1
    assert err.splitlines() == [
        f"{extra}: http_optons: unknown key; did you mean 'http_options'?",
        f"{extra}: applications[0].rute_prefix: unknown key; did you mean 'route_prefix'?",
        f"afd-ray: error: {extra}: 2 errors",
    ]


def test_unknown_keys_of_the_config_tree_name_the_nearest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a fresh-user trial: a misspelt key of the app's own config tree got
    pydantic's bare "Extra inputs are not permitted", where the Serve file's keys name
    the nearest valid one."""
    path = _app_file(tmp_path, ffn={"num_rank": 2, "eplb": {"window": 8}}, attention={"kv_cache_gb": 1})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    for key, near in [
        ("ffn.num_rank", "num_ranks"),
        ("ffn.eplb.window", "window_size"),
        ("attention.kv_cache_gb", "kv_cache_gib"),
    ]:
        line = f"{path}: {APP}.{key}: Extra inputs are not permitted; did you mean {near!r}?"
        assert line in err.splitlines(), err


def test_a_value_out_of_vllms_config_bounds_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a fresh-user trial: `block_size: -5` passed the check and failed only at
    engine start (vLLM's `CacheConfig` bounds it), leaving the app starting."""
    path = _app_file(tmp_path, attention={"engine_args": {"block_size": -5, "max_num_batched_tokens": 0, "seed": 7}})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    lines = err.splitlines()
    where = f"{path}: {APP}.attention.engine_args"
    assert f"{where}.block_size: -5 does not fit vLLM's CacheConfig.block_size: Input should be greater than 0" in lines
    assert (
        f"{where}.max_num_batched_tokens: 0 does not fit vLLM's SchedulerConfig.max_num_batched_tokens: "
        "Input should be greater than or equal to 1" in lines
    ), err
    assert lines[-1] == f"afd-ray: error: {path}: 2 errors"
    ok = _app_file(tmp_path, attention={"engine_args": {"block_size": 16, "max_num_batched_tokens": 512}})
    assert _check(capsys, str(ok), "--offline")[0] == 0


def test_the_cli_and_the_check_import_neither_torch_nor_transformers() -> None:
    """`afd-ray --help` took 5 s: `afd_ray.serve.check` imported `afd_ray.layers.fp8`
    (torch, transformers, vLLM) for one constant (new-user trial); 0.3 s without."""
    code = "import sys, afd_ray.cli, afd_ray.serve.check; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_python_m_afd_ray_cli_runs_the_cli() -> None:
    """`python -m afd_ray.cli --help` printed nothing and exited 0 (new-user trial)."""
    done = subprocess.run([sys.executable, "-m", "afd_ray.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done
