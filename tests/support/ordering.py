"""The order xdist hands out the tests in: the long ones first, longest first.

tests/conftest.py registers this module as a plugin.  Under ``--dist
loadgroup`` xdist's scheduler makes one work unit of each group (``spark``)
and one of every other test, puts the units of more tests first
(the groups) and then hands out the single tests *in collection order*, to
whichever worker is free.  In collection order a drill or a local-cluster
Spark job of ``tests/tools`` or ``tests/pipeline`` could start when the other
worker had little left: the run then ended with one worker busy on it and the
other idle (the tail).  So the single tests are handed out heaviest kind
first: the Spark tests that start their own JVMs, then the tests that start
processes (``slow``), then the pure and in-process ones, whose small pieces
fill the end of the run on both workers evenly.  Within a kind the order
stays the collection's (a file's tests together, as before).

Within the slow kind, collection order still left the longest tests for
last: ``tests/tools`` (the chaos run, 65 s; the bench sections, 20-28 s) comes
late in it, and the worker that took the Spark group (about 280 s) took the
chaos run when it was done, 400 s into the run: the others had ended 45-70 s
before.  So the tests whose time a whole run measured (``durations.json``:
every test that took 3 s or more, setup to teardown) go first, longest first,
as a scheduler that knows the jobs' lengths does (longest processing time
first); what the file does not name follows by kind.  The tests of a group
(``xdist_group``: the shared Spark session's) keep their order: xdist hands a
group out whole, and its tests share one JVM.

To measure again (after tests changed a lot): a whole run with
``--junitxml=FILE``, then ``python -m tests.support.ordering FILE``.

Only under xdist's ``loadgroup`` (what scripts/test runs): a run in one
process keeps pytest's order.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from functools import cache
from pathlib import Path

import pytest

__all__ = ["known_seconds", "order_key", "weight"]

DURATIONS = Path(__file__).with_name("durations.json")
#: Tests at least this long are named in ``durations.json``.
RECORDED_FROM = 3.0
# xdist's group suffix on a test id (``...::test_x@spark``).
_GROUP_SUFFIX = re.compile(r"@\w+$")


def weight(item: pytest.Item) -> int:
    """0 for the heaviest kind of test, 2 for the lightest (a sort key)."""
    if item.get_closest_marker("spark") is not None:
        return 0
    if item.get_closest_marker("slow") is not None:
        return 1
    return 2


@cache
def _recorded() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no file, or a broken one: the order by kind alone
    return {str(k): float(v) for k, v in data.items()}


def known_seconds(nodeid: str) -> float | None:
    """How long the test took in the recorded run, if 3 s or more."""
    return _recorded().get(_GROUP_SUFFIX.sub("", nodeid))


def order_key(item: pytest.Item) -> tuple[int, float, int]:
    """A sort key: the grouped tests (in their kind's order), then the tests
    the recorded run measured, longest first, then the rest by kind."""
    if item.get_closest_marker("xdist_group") is not None:
        return (0, 0.0, weight(item))
    seconds = known_seconds(item.nodeid)
    if seconds is not None:
        return (1, -seconds, 0)
    return (2, 0.0, weight(item))


# After tests/support/markers.py has given ``slow`` and ``spark`` (tryfirst),
# before xdist's worker reports the collection (pytest_collection_finish).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers
        return
    items.sort(key=order_key)  # stable: the collection's order within a kind


def record(junit_xml: str, out: Path = DURATIONS) -> int:
    """Write ``durations.json`` from a whole run's JUnit XML (each test's
    setup + call + teardown): the tests of :data:`RECORDED_FROM` seconds or
    more, longest first, but a group's (handed out whole, in its order).
    Returns how many."""
    root = ET.parse(junit_xml).getroot()
    found: dict[str, float] = {}
    for case in root.iter("testcase"):
        seconds = float(case.get("time") or 0)
        if seconds < RECORDED_FROM:
            continue
        name = case.get("name") or ""
        if "@" in name:  # a group's test (xdist's suffix): the group keeps its order
            continue
        path = (case.get("classname") or "").replace(".", "/") + ".py"
        found[f"{path}::{name}"] = round(seconds, 1)
    ranked = dict(sorted(found.items(), key=lambda kv: -kv[1]))
    out.write_text(json.dumps(ranked, indent=0) + "\n", encoding="utf-8")
    return len(ranked)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.ordering JUNIT_XML")
    print(f"{record(sys.argv[1])} tests written to {DURATIONS}")
