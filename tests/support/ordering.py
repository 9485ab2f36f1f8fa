"""The order xdist hands out the tests in: the long ones first.

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

Only under xdist's ``loadgroup`` (what scripts/test runs): a run in one
process keeps pytest's order.
"""

from __future__ import annotations

import pytest

__all__ = ["weight"]


def weight(item: pytest.Item) -> int:
    """0 for the heaviest kind of test, 2 for the lightest (a sort key)."""
    if item.get_closest_marker("spark") is not None:
        return 0
    if item.get_closest_marker("slow") is not None:
        return 1
    return 2


# After tests/support/markers.py has given ``slow`` and ``spark`` (tryfirst),
# before xdist's worker reports the collection (pytest_collection_finish).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers
        return
    items.sort(key=weight)  # stable: the collection's order within a kind
