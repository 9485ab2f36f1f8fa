"""scripts/run's supervisor (clone/tools/run_pair.py) without servers.

The pure parts (port plan, command lines, back-off) are checked as tables; the
supervision loop runs in this process over tiny Python children that exit,
ignore SIGTERM or signal their parent, so restarts and stops take well under a
second each.  (tests/tools/test_run_script.py runs the real script over real servers.)
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from clone.server.cli import build_parser, config_from_args
from clone.tools.run_pair import (
    Backoff,
    PairPorts,
    PairSupervisor,
    RestartPolicy,
    main,
    server_argvs,
)

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", code]


# -- the port plan --------------------------------------------------------------


def test_without_port_the_pair_is_the_guides() -> None:
    assert PairPorts.for_base(None) == PairPorts(5556, 5003, 5566, 5004)


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        (20000, PairPorts(20000, 20003, 20010, 20013)),
        (65522, PairPorts(65522, 65525, 65532, 65535)),
    ],
)
def test_port_moves_all_four(base: int, expected: PairPorts) -> None:
    assert PairPorts.for_base(base) == expected


@pytest.mark.parametrize("base", [0, -1, 65523, 70000])
def test_port_out_of_range_is_refused(base: int) -> None:
    with pytest.raises(ValueError, match=r"must fit in 1\.\.65535"):
        PairPorts.for_base(base)


def test_each_server_names_the_other_as_its_peer() -> None:
    ports = PairPorts.for_base(20000)
    argvs = server_argvs(ports, "127.0.0.1", ["--heartbeat", "100"])
    primary = config_from_args(build_parser().parse_args(argvs["primary"]))
    backup = config_from_args(build_parser().parse_args(argvs["backup"]))
    assert (primary.port, primary.ha_port) == (20000, 20003)
    assert (primary.peer, primary.peer_ha) == ("localhost:20010", "localhost:20013")
    assert (backup.port, backup.ha_port) == (20010, 20013)
    assert (backup.peer, backup.peer_ha) == ("localhost:20000", "localhost:20003")
    assert primary.bind == backup.bind == "127.0.0.1"
    assert primary.heartbeat == backup.heartbeat == 0.1  # extra flags go to both


def test_each_server_keeps_its_state_in_its_own_directory(tmp_path: Path) -> None:
    ports = PairPorts.for_base(20000)
    argvs = server_argvs(ports, "127.0.0.1", [], tmp_path)
    primary = config_from_args(build_parser().parse_args(argvs["primary"]))
    backup = config_from_args(build_parser().parse_args(argvs["backup"]))
    assert primary.data_dir == str(tmp_path / "primary-20000")
    assert backup.data_dir == str(tmp_path / "backup-20010")
    memory = server_argvs(ports, "127.0.0.1", ["--in-memory"], tmp_path)
    assert config_from_args(build_parser().parse_args(memory["primary"])).data_dir is None


def test_one_data_dir_for_both_servers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--data-dir", "/tmp/x"])
    assert exited.value.code == 2
    assert "--data-dir is set by this script" in capsys.readouterr().err


# -- the back-off ---------------------------------------------------------------


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run() -> None:
    backoff = Backoff(RestartPolicy(initial=0.5, factor=2, cap=10, stable_after=30))
    uptimes = [0.1, 0.1, 2, 5, 0, 29.9, 0, 30, 1, 31]
    delays = [backoff.delay_after(u) for u in uptimes]
    assert delays == [0.5, 1, 2, 4, 8, 10, 10, 0.5, 1, 0.5]


@pytest.mark.parametrize(
    "kwargs", [{"initial": 0}, {"initial": 20, "cap": 10}, {"factor": 0.5}, {"stable_after": 0}]
)
def test_nonsensical_restart_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="nonsensical restart policy"):
        RestartPolicy(**kwargs)


# -- the command line -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [["--primary"], ["--backup"], ["--standalone"], ["--peer=h:1"], ["--ha-port", "9"]]
)
def test_flags_the_script_sets_itself_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "is set by this script for each server; use --port" in capsys.readouterr().err


def test_a_bad_port_or_server_flag_fails_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--port", "65530"])
    assert exc.value.code == 2
    assert "must fit in 1..65535" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--heartbeat", "0"])
    assert exc.value.code == 2
    assert "clone-server: error: argument --heartbeat" in capsys.readouterr().err


# -- the supervision loop, in this process ---------------------------------------

# Signals the supervisor (this process, its parent) with SIGTERM after a delay.
_STOPPER = "import os, signal, time; time.sleep({delay}); os.kill(os.getppid(), signal.SIGTERM)"


def _run(sup: PairSupervisor) -> tuple[int, dict[str, int], float]:
    started: dict[str, int] = {}
    sup.on_started = started.update
    t0 = time.monotonic()
    code = sup.run()
    return code, started, time.monotonic() - t0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# Signals the supervisor with SIGTERM once {path} holds {runs} marks (one per
# run of the flaky member): after its restarts, however slowly they come.
_STOP_AFTER_RUNS = (
    "import os, signal, time\n"
    "while not (os.path.exists({path!r}) and len(open({path!r}).read()) >= {runs}):\n"
    "    time.sleep(0.01)\n"
    "os.kill(os.getppid(), signal.SIGTERM)\n"
    "time.sleep(60)\n"
)


@pytest.mark.timeout(30)
def test_a_dying_member_is_restarted_with_backoff_until_sigterm(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, "clone.tools.run_pair")
    runs = str(tmp_path / "runs")
    sup = PairSupervisor(
        {
            # Exits at once, every time, leaving a mark.
            "flaky": _py(f"open({runs!r}, 'a').write('x')"),
            # Four runs: three deaths, restarted after 0.05, 0.1 and 0.2 s.
            "steady": _py(_STOP_AFTER_RUNS.format(path=runs, runs=4)),
        },
        RestartPolicy(initial=0.05, factor=2, cap=0.2, stable_after=30),
    )
    code, started, elapsed = _run(sup)
    assert code == 0
    assert elapsed < 60  # stopped by the SIGTERM, not by the test's timeout
    text = caplog.text
    assert f"flaky (pid {started['flaky']}) died (exit status 0)" in text
    for delay in ("0.05", "0.1", "0.2"):
        assert f"restarting it in {delay} s" in text, text
    assert "restarting it in 0.4 s" not in text  # the cap
    assert "flaky restarted: pid" in text
    assert "steady restarted" not in text  # the survivor is left alone
    assert "SIGTERM received: stopping both servers" in text
    assert _gone(started["steady"])


@pytest.mark.timeout(30)
def test_a_member_that_refuses_its_flags_stops_the_pair(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = PairSupervisor(
        {"bad": _py("raise SystemExit(2)"), "other": _py("import time; time.sleep(60)")}
    )
    code, started, elapsed = _run(sup)
    assert code == 2
    assert elapsed < 10
    assert "bad refused its flags" in caplog.text
    assert "restarted" not in caplog.text
    assert _gone(started["other"])


@pytest.mark.timeout(30)
def test_a_member_that_ignores_sigterm_is_killed_after_the_stop_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    sup = PairSupervisor(
        {"stubborn": _py(ignore + _STOPPER.format(delay=0.3) + "; time.sleep(60)")},
        stop_timeout=0.5,
    )
    code, started, elapsed = _run(sup)
    assert code == 0
    assert elapsed < 10
    assert "servers still running 0.5 s after SIGTERM: killing them" in caplog.text
    assert _gone(started["stubborn"])


@pytest.mark.timeout(30)
def test_a_second_stop_signal_kills_at_once(caplog: pytest.LogCaptureFixture) -> None:
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    twice = _STOPPER.format(delay=0.3) + "; " + _STOPPER.format(delay=0.2) + "; time.sleep(60)"
    sup = PairSupervisor({"stubborn": _py(ignore + twice)}, stop_timeout=60)
    code, started, elapsed = _run(sup)
    assert code == 0
    assert elapsed < 10
    assert "second stop signal: killing the servers" in caplog.text
    assert _gone(started["stubborn"])


def test_the_supervisor_restores_the_signal_handlers() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sup = PairSupervisor({"x": _py(_STOPPER.format(delay=0.1) + "; time.sleep(60)")})
    assert sup.run() == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before


# -- --http-port for both, and a server that cannot start -----------------


def test_http_port_gives_the_backup_the_next_port() -> None:
    argvs = server_argvs(PairPorts.for_base(20000), "127.0.0.1", (), None, http_port=32020)
    primary = config_from_args(build_parser().parse_args(argvs["primary"]))
    backup = config_from_args(build_parser().parse_args(argvs["backup"]))
    assert (primary.http_port, backup.http_port) == (32020, 32021)


def test_without_http_port_neither_serves_http() -> None:
    argvs = server_argvs(PairPorts.for_base(20000), "127.0.0.1")
    assert not any("--http-port" in argv for argv in argvs.values())


@pytest.mark.timeout(30)
def test_a_member_that_cannot_start_stops_the_pair_with_its_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "clone.tools.run_pair")
    # What clone-server does for a port in use: logs the cause, exits 3.
    cannot = "import sys; print('ERROR cannot bind the HTTP port *:1: in use', file=sys.stderr);"
    sup = PairSupervisor(
        {
            "bad": _py(cannot + " raise SystemExit(3)"),
            "other": _py("import time; time.sleep(60)"),
        },
        RestartPolicy(initial=0.05, factor=1, cap=0.05, stable_after=30),
    )
    code, started, elapsed = _run(sup)
    assert code == 1
    assert elapsed < 10
    text = caplog.text
    assert (
        "bad could not start, 3 times in a row: ERROR cannot bind the HTTP port *:1: in use;"
        " stopping the pair" in text
    ), text
    assert text.count("bad restarted") == 2
    assert _gone(started["other"])


@pytest.mark.timeout(30)
def test_a_member_that_crashes_after_starting_is_still_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "clone.tools.run_pair")
    # Exit 1 (failed while serving) is not a start failure: no giving up.
    sup = PairSupervisor(
        {
            "crashy": _py("raise SystemExit(1)"),
            "steady": _py(_STOPPER.format(delay=1.5) + "; time.sleep(60)"),
        },
        RestartPolicy(initial=0.05, factor=1, cap=0.05, stable_after=30),
    )
    code, _, _ = _run(sup)
    assert code == 0
    assert caplog.text.count("crashy restarted") >= 3
    assert "could not start" not in caplog.text
