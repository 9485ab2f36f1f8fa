"""Markers that stay true: ``slow`` and ``spark`` are given by code, not by hand.

tests/conftest.py registers this module as a plugin.  It does three things:

1. **Marks at collection** (:func:`pytest_collection_modifyitems`).  A test is
   ``slow`` when it, or any fixture it uses (however indirectly), reaches code
   that starts a process: the ``subprocess`` and ``multiprocessing`` modules,
   ``os.fork``/``os.system``/``os.posix_spawn``, and through them the
   ``servers`` fixture, ``Servers``/``ServerProcess``, console scripts, drills.
   A test is ``spark`` when it or its fixtures use the ``spark`` fixture or
   pyspark.  "Reaches" is read from the code: the names each function uses
   (``co_names``), followed through the functions and classes of the ``tests``
   package and of ``clone.tools`` (the drills, benches and pair runner, which
   start servers).  So a new test file is marked without being listed here.

2. **Checks at run time** (:func:`pytest_runtest_protocol`).  While a test
   that is neither ``slow`` nor ``spark`` runs (setup, call and teardown), every
   way of starting a process raises :class:`ProcessInFastTest` before the
   process exists.  What the reading of the code missed (a process started
   through a method call, say) fails loudly, naming the test, instead of
   making the quick set lie; the fix is ``@pytest.mark.slow`` on the test.
   ``scripts/test --quick`` (``-m "not slow and not spark"``) so starts no
   server, no subprocess and no JVM.

3. **Timeouts per marker.**  ``setup.cfg``'s 60 s (pytest-timeout, ``signal``
   method) stays for the fast tests.  ``slow`` tests get at least
   :data:`SLOW_TIMEOUT`: their servers run on a machine that may be busy, and
   the ceiling only bounds a hang.  ``spark`` tests get at least
   :data:`SPARK_TIMEOUT`, with the ``signal`` method like every other test.
   The signal raises inside whatever Python is running, which for a Spark
   test is mostly a Py4J call waiting for the JVM's answer; the answer would
   then arrive for the *next* call and every later Spark test would fail
   (``KeyError: 'm'``, "... does not exist in the JVM").  So the ``spark``
   fixture (tests/support/spark_session.py) kills the JVM after a Spark test
   that failed with anything but an AssertionError (a timeout among them), and
   the next Spark test starts a new session: one test fails, not thirty.
   Not the ``thread`` method: it ends the whole worker process, and xdist
   3.8's ``loadgroup`` scheduler then hangs the run for good once it replaces
   the worker (pytest-dev/pytest-xdist#1323, #1327 and #1378: the crashed worker's
   finished work goes back on the queue).  A CI run under load did exactly
   that: a Spark test ran out of time, the worker was replaced, and the run
   sat idle until it was stopped.  (pytest-timeout's ``timeout_func_only``
   would not help: it only leaves fixtures out of the time; the call is still
   interrupted.)

4. **Groups that reach xdist.**  The Spark tests of the shared session run on
   one worker (``xdist_group("spark")``); a Spark test that starts its own
   JVMs in child processes is not grouped.  The partition drills are not
   grouped either: each holds its subnet by a lock
   (``clone.tools.drill.netns``), so several run at once.
   :class:`GroupIds` writes the ``@group`` suffix into the
   test's id that xdist's scheduler reads, which xdist 3.8 cannot do under
   pytest 9.
"""

from __future__ import annotations

import contextlib
import dis
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = [
    "ALL_ITEMS",
    "GroupIds",
    "SLOW_TIMEOUT",
    "SPARK_TIMEOUT",
    "ProcessInFastTest",
    "paused",
    "process_fixtures",
    "refuse_in_fast_test",
    "uses",
]

#: Ceilings (seconds) that only bound a hang on a loaded machine.
SLOW_TIMEOUT = 180.0
SPARK_TIMEOUT = 300.0

#: Fixtures that are real processes or Spark by what they are, whatever their code.
PROCESS_FIXTURE_NAMES = frozenset({"servers"})
SPARK_FIXTURE_NAMES = frozenset({"spark"})

#: Modules whose use means a process is started (matplotlib: its first use on a
#: machine builds the font cache by running ``fc-list``).
_PROCESS_MODULES = (
    "subprocess", "multiprocessing", "concurrent.futures.process", "pty", "matplotlib",
)
#: ``os`` functions that start a process (read as attribute names next to ``os``).
_OS_STARTERS = frozenset(
    {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
     "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "execv", "execve"}
)
#: Where the reading follows names into: our tests and the tools that start servers.
_FOLLOW = ("tests.", "clone.tools.")

#: Every collected test of the run, before ``-m`` deselects any.
ALL_ITEMS = pytest.StashKey[list[pytest.Item]]()

Kinds = frozenset[str]
_NONE: Kinds = frozenset()


class ProcessInFastTest(RuntimeError):
    """A test that is neither ``slow`` nor ``spark`` tried to start a process."""


# --------------------------------------------------------------------------
# 1. Reading the code: which tests reach a process or Spark


def _module_kind(name: str) -> Kinds:
    if name.startswith("pyspark"):
        return frozenset({"spark"})
    if any(name == m or name.startswith(m + ".") for m in _PROCESS_MODULES):
        return frozenset({"process"})
    return _NONE


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those nested in it (lambdas, inner functions, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


#: The opcode of ``import``, as it stands in ``co_code`` (2-byte code units).
_IMPORT_OPCODE = bytes([dis.opmap["IMPORT_NAME"]])


def _imported(code: types.CodeType) -> Iterator[str]:
    """The modules a function imports in its body (``import x`` / ``from x import y``).

    Most functions import nothing: a look at the opcodes first spares them the
    disassembly, which was half of each worker's collection time (1.7 of
    3.3 CPU-seconds)."""
    if _IMPORT_OPCODE not in code.co_code[::2]:
        return
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            yield str(ins.argval)


class _Reader:
    """Memoised answer to "what does this object reach?" (a set of kinds)."""

    def __init__(self) -> None:
        self._seen: dict[int, Kinds] = {}

    def kinds(self, obj: object) -> Kinds:
        key = id(obj)
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = _NONE  # a cycle reaches nothing new
        found = self._read(obj)
        self._seen[key] = found
        return found

    def _read(self, obj: object) -> Kinds:
        if isinstance(obj, types.ModuleType):
            return _module_kind(obj.__name__)
        module = getattr(obj, "__module__", None) or ""
        direct = _module_kind(module)
        if direct:
            return direct
        if not module.startswith(_FOLLOW):
            return _NONE
        if isinstance(obj, type):
            found: set[str] = set()
            for member in vars(obj).values():
                func = member
                if isinstance(member, (staticmethod, classmethod)):
                    func = member.__func__
                if isinstance(func, property):
                    func = func.fget
                if isinstance(func, types.FunctionType):
                    found |= self.kinds(func)
            return frozenset(found)
        return self.code_of(obj)

    def code_of(self, obj: object) -> Kinds:
        """What a test or fixture function reaches, wherever it is defined."""
        func = getattr(obj, "__wrapped__", obj)
        if not isinstance(func, types.FunctionType):
            return _NONE
        key = id(func.__code__)
        if key not in self._seen:
            self._seen[key] = _NONE
            self._seen[key] = self._function(func)
        return self._seen[key]

    def _function(self, func: types.FunctionType) -> Kinds:
        found: set[str] = set()
        names: set[str] = set()
        for code in _codes(func.__code__):
            names.update(code.co_names)
            for module in _imported(code):
                found |= _module_kind(module)
        if "os" in names and names & _OS_STARTERS:
            found.add("process")
        scope = func.__globals__
        for name in names:
            if name not in scope:
                continue
            value = scope[name]
            found |= self.kinds(value)
            if isinstance(value, types.ModuleType) and value.__name__.startswith(_FOLLOW):
                # ``drill.main(...)``: follow the attributes used on a module of ours.
                for attr in names & set(vars(value)):
                    found |= self.kinds(getattr(value, attr))
        # Defaults and closures can hold a helper too.
        for cell in func.__closure__ or ():
            try:
                found |= self.kinds(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        return frozenset(found)


_reader = _Reader()


def uses(item: pytest.Item) -> Kinds:
    """What ``item`` reaches, through its own code and every fixture it uses:
    ``{"process"}``, ``{"spark"}``, both or neither."""
    found: set[str] = set()
    names = set(getattr(item, "fixturenames", ()))
    if names & PROCESS_FIXTURE_NAMES:
        found.add("process")
    if names & SPARK_FIXTURE_NAMES:
        found.add("spark")
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:
            if fixturedef.argname in SPARK_FIXTURE_NAMES:
                continue  # the session's own code is Spark, not a process of the test
            found |= _reader.code_of(fixturedef.func)
    function = getattr(item, "function", None)
    if function is not None:
        found |= _reader.code_of(function)
    return frozenset(found)


def process_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures ``item`` uses that start a process (for messages and the check)."""
    info = getattr(item, "_fixtureinfo", None)
    out = []
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        if name in PROCESS_FIXTURE_NAMES or any(
            "process" in _reader.code_of(d.func) for d in defs
            if d.argname not in SPARK_FIXTURE_NAMES
        ):
            out.append(name)
    return sorted(out)


def _timeout(item: pytest.Item, floor: float, method: str | None) -> None:
    """Put a timeout of at least ``floor`` first among ``item``'s markers."""
    current = item.get_closest_marker("timeout")
    seconds = floor
    if current is not None:
        given = current.args[0] if current.args else current.kwargs.get("timeout")
        if given is not None:
            seconds = max(floor, float(given))
    kwargs: dict[str, Any] = {}
    if method is not None:
        kwargs["method"] = method
    item.add_marker(pytest.mark.timeout(seconds, **kwargs), append=False)


@pytest.hookimpl(tryfirst=True)  # before -m deselects and xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[ALL_ITEMS] = items[:]  # before -m deselects: for tests/test_markers.py
    for item in items:
        found = uses(item)
        if "process" in found and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if "spark" in found and item.get_closest_marker("spark") is None:
            item.add_marker(pytest.mark.spark)
        if item.get_closest_marker("spark") is not None:
            _timeout(item, SPARK_TIMEOUT, "signal")
            if SPARK_FIXTURE_NAMES & set(getattr(item, "fixturenames", ())):
                # One worker runs the tests of the shared session (loadgroup):
                # one JVM, not one per core.  A Spark test without the fixture
                # runs its Spark in child processes (spark-submit, a
                # local-cluster, the CLI): nothing to share, so it runs on
                # whichever worker is free, next to the group, not after it.
                item.add_marker(pytest.mark.xdist_group("spark"))
        elif item.get_closest_marker("slow") is not None:
            _timeout(item, SLOW_TIMEOUT, None)


class GroupIds:
    """Gives each grouped test the ``@group`` suffix xdist's ``loadgroup``
    schedules by, when xdist could not.

    xdist tells its scheduler a test's group by appending ``@name`` to the
    test's id on the worker (``item._nodeid = ...``).  pytest 9 keeps the id
    in ``item._id`` and ignores ``_nodeid``: with xdist 3.8 the groups were
    silently dropped, every Spark test's worker started its own session and
    two partition drills could pick the same subnet at once.  So the suffix is
    added here (a plugin of its own: after xdist's hook), in xdist's own form,
    wherever it is missing.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = sorted({
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            })
            if not names or item.nodeid.rfind("@") > item.nodeid.rfind("]"):
                continue  # no group, or xdist's suffix is there
            if hasattr(item, "_id"):  # pytest 9's id
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# --------------------------------------------------------------------------
# 2. The run-time check: a fast test starts no process


#: The test running now (None: a pause, see :func:`paused`).
_current: list[pytest.Item | None] = []


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Let the code in the block start processes (a nested collection imports
    modules, and some imports run ``ldconfig``, as collection always may)."""
    _current.append(None)
    try:
        yield
    finally:
        _current.pop()


def refuse_in_fast_test(what: str, detail: str = "") -> None:
    """Raise :class:`ProcessInFastTest` if the test running now is neither
    ``slow`` nor ``spark``: a process is about to start (``what``).  Also
    called by the zygote (tests/support/zygote.py), whose children are
    forked by a process started long before the test."""
    item = _current[-1] if _current else None
    if item is None:
        return
    if item.get_closest_marker("slow") is None and item.get_closest_marker("spark") is None:
        raise ProcessInFastTest(
            f"{item.nodeid} is not marked slow but starts a process ({what}{detail}): "
            "mark it @pytest.mark.slow (the quick set starts no process)"
        )


def _guarded(what: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def guard(*args: Any, **kwargs: Any) -> Any:
        detail = ""
        if what == "subprocess" and len(args) > 1:
            detail = f" {args[1]!r}"  # fork_exec's executable list
        refuse_in_fast_test(what, detail)
        return real(*args, **kwargs)

    guard.__wrapped__ = real  # type: ignore[attr-defined]
    return guard


def _install() -> None:
    import _posixsubprocess

    if getattr(subprocess, "_clone_guarded", False):
        return
    subprocess._fork_exec = _guarded("subprocess", subprocess._fork_exec)  # type: ignore[attr-defined]
    _posixsubprocess.fork_exec = _guarded("subprocess", _posixsubprocess.fork_exec)
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _guarded(f"os.{name}", getattr(os, name)))
    subprocess._clone_guarded = True  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it too; without xdist (-p no:xdist) --strict-markers needs it here.
    config.addinivalue_line("markers", "xdist_group(name): run on the worker of that group")
    if not config.pluginmanager.has_plugin("clone-xdist-group-ids"):
        config.pluginmanager.register(GroupIds(), "clone-xdist-group-ids")
    if sys.platform.startswith("linux"):
        _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()
