"""Reloading the autoscaling policy: validation before anything is applied (no cluster).

The live route (`POST /afd/autoscale/policy`: a good policy applied, a bad one a 400
naming the field) runs in `examples/03_autoscale_tuning.ipynb`, executed by
tests/examples/test_notebooks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_ray.autoscale.loader import PolicyError, load_policy, parse_policy
from afd_ray.cli import main

SHIPPED = Path(__file__).parents[2] / "deployments" / "autoscale.yaml"


def test_the_shipped_policy_round_trips_through_text() -> None:
    assert parse_policy(SHIPPED.read_text()) == load_policy(SHIPPED)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("attention:\n  min_ranks: 3\n  max_ranks: 2\n", "attention"),
        ("ffn:\n  scale_in_cooldown_s: -1\n", "ffn.scale_in_cooldown_s"),
        (
            "attention:\n  signals:\n    kv_cache_usage: {scale_out: 0.5, scale_in: 0.9}\n",
            "attention.signals.kv_cache_usage",
        ),
        ("attention:\n  no_such_key: 1\n", "attention.no_such_key"),
    ],
)
def test_bad_policy_names_the_field(text: str, field: str) -> None:
    with pytest.raises(PolicyError, match=field) as info:
        parse_policy(text, "body")
    assert str(info.value).startswith("body: ")
    assert info.value.fields[0].startswith(field)


def test_text_that_is_not_yaml_names_no_field() -> None:
    with pytest.raises(PolicyError, match="not valid YAML") as info:
        parse_policy("attention: [", "body")
    assert info.value.fields == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # said only "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
        (b"\xff\xfeattention:\n", "not UTF-8 text (invalid start byte at byte 0); a policy is a YAML file"),
        # said "<root>: Input should be a valid dictionary or instance of AutoscalePolicy"
        (
            b"",
            "expected a YAML mapping with an `attention` and/or an `ffn` section "
            "(e.g. deployments/autoscale.yaml), got an empty document",
        ),
        (
            b"- 1\n",
            "expected a YAML mapping with an `attention` and/or an `ffn` section "
            "(e.g. deployments/autoscale.yaml), got a list",
        ),
    ],
    ids=["not-utf8", "empty", "list"],
)
def test_a_policy_file_that_is_no_mapping_names_the_file_and_what_is_expected(
    content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(PolicyError, match="bad.yaml") as info:
        load_policy(bad)
    assert str(info.value) == f"{bad}: {message}"
    with pytest.raises(SystemExit) as exit_info:
        main(["autoscale", "simulate", "--policy", str(bad), "--ramp"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"afd-ray: error: {bad}: {message}"


def test_cli_apply_rejects_a_bad_file_before_sending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("ffn:\n  step: 0\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["autoscale", "apply", "--policy", str(bad), "--url", "http://127.0.0.1:9"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "ffn.step" in err and "127.0.0.1:9" not in err  # validated locally, nothing sent


@pytest.mark.parametrize(
    "command",
    [["autoscale", "apply", "--policy", str(SHIPPED)], ["scale", "--attention", "1", "--ffn", "1"]],
    ids=["autoscale-apply", "scale"],
)
def test_cli_names_an_unset_admin_key_variable(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AFD_TEST_UNSET_ADMIN_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--url", "http://127.0.0.1:9", "--admin-key-env", "AFD_TEST_UNSET_ADMIN_KEY"])
    assert exit_info.value.code == 1
    assert "--admin-key-env: environment variable AFD_TEST_UNSET_ADMIN_KEY is unset" in capsys.readouterr().err
