"""`afd-ray check FILE.yaml`: every error of a config file with its key path, exit
status 1 on an error; the pools against a running Ray cluster only where one runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from afd_ray.cli import main
from afd_ray.config import AFDConfig
from afd_ray.serve.check import ClusterResources, fp8_device_errors

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
