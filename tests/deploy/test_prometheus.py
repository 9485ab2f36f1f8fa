"""deploy/prometheus: the rules load, name only metrics a server serves, and the
scrape configuration covers a pair.

``promtool check`` runs when Debian's ``prometheus`` package is installed (it is
large, so scripts/test does not install it); the YAML checks and the metric
check against a live server run always (the live check in
test_example_pair_e2e.py, which has a pair serving /metrics).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.files import DEPLOY, RULES, SCRAPE_SERIES, rule_exprs, rule_metrics


def _yaml(path: Path) -> Any:
    """The file loaded with PyYAML (the test extra); the test skips without it."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is missing (the test extra: .[test])")
    return yaml.safe_load(path.read_text())


SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"


def load_rules() -> list[dict[str, Any]]:
    data = _yaml(RULES)
    return [rule for group in data["groups"] for rule in group["rules"]]


def metrics_of_rules() -> set[str]:
    """Every metric the rules read that a clone-server must serve."""
    return set().union(*(rule_metrics(e) for e in rule_exprs())) - SCRAPE_SERIES


def test_the_rules_file_is_a_prometheus_rules_file() -> None:
    data = _yaml(RULES)
    assert [g["name"] for g in data["groups"]] == ["clone"]
    rules = load_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"]


def test_the_expressions_read_as_lines_are_those_yaml_loads() -> None:
    # The live metric check (test_example_pair_e2e.py) reads them as lines.
    assert rule_exprs() == [rule["expr"] for rule in load_rules()]


def test_the_rules_are_those_operations_md_shows() -> None:
    page = (DEPLOY.parent / "docs" / "operations.md").read_text()
    for rule in load_rules():
        assert f"alert: {rule['alert']}" in page
        assert f"expr: {rule['expr']}" in page


def test_the_scrape_configuration_covers_a_pair_and_loads_the_rules() -> None:
    data = _yaml(SCRAPE)
    assert data["rule_files"] == [RULES.name]
    (job,) = data["scrape_configs"]
    (targets,) = job["static_configs"]
    assert len(targets["targets"]) == 2
    assert targets["labels"]["pair"]  # the rules sum by pair
    # The targets are the example configs' HTTP ports.
    from tests.deploy.files import example_config

    expected = {f"{example_config(r)['bind']}:{example_config(r)['http-port']}"
                for r in ("primary", "backup")}
    assert set(targets["targets"]) == expected


def test_rule_metrics_finds_the_metric_names_of_an_expression() -> None:
    expr = ('sum by (instance, reason) (rate(clone_updates_refused_total{reason!="dup"}[5m]))'
            ' > 0.1 and on (pair) clone_in_step == 0 or up{job="clone"} == 0')
    assert rule_metrics(expr) == {"clone_updates_refused_total", "clone_in_step", "up"}
    assert metrics_of_rules() >= {"clone_role", "clone_peer_up", "clone_in_step"}


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is missing (Debian's prometheus package, not installed by scripts/test)",
)
def test_promtool_checks_the_rules_and_the_configuration() -> None:
    for args in (["check", "rules", str(RULES)], ["check", "config", str(SCRAPE)]):
        result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
