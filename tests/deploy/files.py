"""Where deploy/ is, and the small readers its tests share."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

__all__ = [
    "DEPLOY",
    "ROLES",
    "RULES",
    "SCRAPE_SERIES",
    "example_config",
    "rule_exprs",
    "rule_metrics",
    "served_metrics",
    "toml_text",
    "unit_settings",
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROLES = ("primary", "backup")
RULES = DEPLOY / "prometheus" / "clone-rules.yml"
# Series Prometheus makes itself for every target, not served by clone-server.
SCRAPE_SERIES = frozenset({"up"})

# PromQL words that look like metric names: operators, modifiers, aggregations'
# clauses.  Functions and aggregations are followed by "(" and are dropped by that.
_PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
     "bool", "offset", "inf", "nan"}
)


def example_config(role: str) -> dict[str, Any]:
    """deploy/<role>/clone-server.toml.example as a dict."""
    with open(DEPLOY / role / "clone-server.toml.example", "rb") as f:
        return tomllib.load(f)


def toml_text(settings: dict[str, Any]) -> str:
    """A flat TOML file of strings, numbers and booleans."""
    lines = []
    for key, value in settings.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, int | float):
            lines.append(f"{key} = {value!r}")
        else:
            lines.append(f'{key} = "{value}"')
    return "\n".join(lines) + "\n"


def unit_settings(path: Path) -> dict[str, list[str]]:
    """A unit file's ``Key=value`` lines, every value of each key, sections merged."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def rule_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    Label matchers (``{...}``), range selectors (``[5m]``), the labels of
    ``by``/``without``/``on``/``ignoring`` clauses, strings and numbers are
    removed first; what is left that is not a keyword and not called (a
    function) is a metric name.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, called = match.group(1), match.group(2)
        if not called and name.lower() not in _PROMQL_WORDS:
            names.add(name)
    return names


def rule_exprs() -> list[str]:
    """The ``expr:`` of every rule in clone-rules.yml, read as lines (one each),
    so the live check needs no YAML library; test_prometheus.py checks that
    these are the expressions a YAML load finds."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*expr:\s*(.+)$", RULES.read_text(), re.M)]


def served_metrics(text: str) -> set[str]:
    """The metric names of a Prometheus text exposition (/metrics)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names
