"""`afd-ray check FILE.yaml`: every error of a config file with its key path, exit
status 1 on an error; the pools against a running Ray cluster only where one runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from afd_ray.cli import main
from afd_ray.config import AFDConfig
from afd_ray.serve.check import ClusterResources, cluster_errors, fp8_device_errors

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


def test_a_quantized_checkpoint_is_refused_naming_its_quantization_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The FFN role loads model-dtype experts only (FP8 ones it makes itself)."""
    folder = tmp_path / "fp8-checkpoint"
    folder.mkdir()
    quantized = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": quantized}))
    path = _app_file(tmp_path, model={"source": str(folder)})
    status, _, err = _check(capsys, str(path), "--offline")
    assert status == 1
    assert (
        f"{path}: {APP}.model.source: '{folder}' is a quantized checkpoint (config.json quantization_config, "
        "quant_method 'fp8')" in err
    ), err
    assert "serve the bf16/fp16 checkpoint with model.quantization: fp8" in err


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
