"""The Grafana dashboard is generated from the metric definitions, the committed
`dashboards/afd.json` is that output, and `push` hands it to grafana-client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from grafana_client.elements.dashboard import Dashboard

from afd_ray.cli import main
from afd_ray.observability.dashboards import DASHBOARD_UID, dashboard, panel_queries
from afd_ray.observability.metrics import METRICS, Kind

COMMITTED = Path(__file__).parents[2] / "dashboards" / "afd.json"
METRICS_PAGE = Path(__file__).parents[2] / "docs" / "observability.md"


def test_committed_dashboard_is_the_generated_one(tmp_path: Path) -> None:
    main(["dashboards", "export", "--out", str(tmp_path / "afd.json")])
    assert json.loads((tmp_path / "afd.json").read_text()) == json.loads(COMMITTED.read_text())


def test_every_metric_is_defined_once_documented_and_charted() -> None:
    names = [metric.name for metric in METRICS]
    assert len(names) == len(set(names)) and all(name.startswith("afd_") for name in names)
    queries = " ".join(expr for _, expr in panel_queries())
    page = METRICS_PAGE.read_text()
    for metric in METRICS:
        assert metric.description and metric.unit, metric.name
        assert (metric.kind is Kind.HISTOGRAM) == bool(metric.buckets), metric.name
        assert list(metric.buckets) == sorted(metric.buckets), metric.name
        assert re.search(rf"\b{metric.series}(_bucket|_sum|_count)?\b", queries), metric.name
        assert f"`{metric.name}`" in page, metric.name


def test_push_hands_the_dashboard_to_grafana_client(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """No Grafana server can run here: the push is checked up to grafana-client's call."""
    sent = []

    def update_dashboard(self: Dashboard, body: dict) -> dict:
        sent.append((self.client.url, self.client.auth.token, body))
        return {"uid": body["dashboard"]["uid"], "status": "success", "version": 1}

    monkeypatch.setattr(Dashboard, "update_dashboard", update_dashboard)
    monkeypatch.setenv("TEST_GRAFANA_TOKEN", "glsa_secret")
    assert main(["dashboards", "push", "--url", "http://grafana.test:3000", "--token-env", "TEST_GRAFANA_TOKEN"]) == 0
    ((url, token, body),) = sent
    assert url == "http://grafana.test:3000/api" and token == "glsa_secret"
    assert body["overwrite"] is True and body["dashboard"] == dashboard()
    assert json.loads(capsys.readouterr().out)["uid"] == DASHBOARD_UID


def test_push_without_the_token_names_the_variable(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["dashboards", "push", "--url", "http://grafana.test:3000", "--token-env", "NO_SUCH_TOKEN"])
    assert exit_.value.code == 1
    assert "--token-env: environment variable NO_SUCH_TOKEN is unset" in capsys.readouterr().err


def test_export_to_an_unwritable_path_names_out(capsys: pytest.CaptureFixture[str]) -> None:
    """It said only "No such file or directory: '/proc/nope'" (new-user trial)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["dashboards", "export", "--out", "/proc/nope/afd.json"])
    assert exit_info.value.code == 1
    assert "afd-ray: error: --out: /proc/nope/afd.json" in capsys.readouterr().err
