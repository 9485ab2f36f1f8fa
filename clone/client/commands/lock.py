"""``clone lock NAME -- COMMAND``: run a command while holding a lock
(:mod:`clone.client.locked` keeps it from outliving the lock)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from clone.client.commands.output import EXIT_CONFLICT, EXIT_ERROR, EXIT_UNREACHABLE

if TYPE_CHECKING:
    from clone.client.frontend import Clone
    from clone.client.locked import LockedCommand

#: clone.client.locked.DEFAULT_KILL_GRACE, not imported for --help's sake (a test
#: keeps them equal).
KILL_GRACE = 2.0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "lock",
        parents=[common],
        help="run COMMAND while holding the lock NAME (like `etcdctl lock`)",
        description="Take the lock NAME (a key prefix, e.g. /locks/backup), run COMMAND,"
        " release the lock, and exit with COMMAND's code. Waiters get the lock in"
        " arrival order; a holder that dies frees it after --ttl. If the lock's lease"
        " is lost while COMMAND runs, COMMAND is sent SIGTERM (SIGKILL after --kill-grace)"
        " and clone exits 4. COMMAND runs in its own process group and dies with clone;"
        " SIGTERM, SIGINT and SIGHUP are passed on to it; a COMMAND killed by signal N"
        " gives 128+N. $CLONE_LOCK_TOKEN holds the lock's fencing token.",
    )
    parser.add_argument("name")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    lock_options(parser)
    parser.set_defaults(handler=run_lock)


def lock_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ttl", type=float, default=5.0, metavar="S", help="the lock's lease ttl (default 5)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="give up (exit 5) if the lock is not ours within S seconds (default: wait)",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=KILL_GRACE,
        metavar="S",
        help="if the lock is lost, SIGKILL the command S seconds after its SIGTERM"
        f" (default {KILL_GRACE:g})",
    )


def lock_command(args: argparse.Namespace) -> list[str]:
    """The command of ``clone lock``, once ``--ttl``/``--wait`` are read.

    REMAINDER takes every word after NAME, so the documented ``clone lock NAME
    --ttl 5 -- COMMAND`` hands us the options too: the words before ``--`` are
    ours when they start with an option (a command never does; without ``--``
    the command's words are refused as unknown options, exit 2).
    """
    command = list(args.cmd)
    if command and command[0] != "--" and command[0].startswith("-"):
        split = command.index("--") if "--" in command else len(command)
        options = argparse.ArgumentParser(prog="clone lock NAME", add_help=False)
        lock_options(options)
        options.parse_args(command[:split], namespace=args)
        command = command[split:]
    if command[:1] == ["--"]:
        command = command[1:]
    return command


class _Stopped(Exception):
    """A forwarded signal arrived while we waited for the lock: leave the queue."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_lock(args: argparse.Namespace, client: Clone) -> int:
    """``clone lock NAME -- COMMAND``: the command runs only while we hold the lock
    (clone.client.locked says how it is kept from outliving it)."""
    command = list(args.cmd)
    if not command:
        print("clone: lock needs a command: clone lock NAME -- COMMAND ...", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.kill_grace < 0:
        print("clone: --kill-grace must be >= 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    from clone.client.locked import FORWARDED_SIGNALS, LOCK_TOKEN_ENV, LockedCommand
    from clone.recipes import Lock

    lock = Lock(client, args.name, ttl=args.ttl)
    running: list[LockedCommand] = []

    def on_signal(signum: int, frame: object) -> None:
        # Before the command runs: leave the queue; after: the command's.
        if not running:
            raise _Stopped(signum)
        running[0].signal_group(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED_SIGNALS}
    try:
        runner: LockedCommand | None = None
        try:
            if not lock.acquire(timeout=args.wait):
                print(
                    f"clone: lock {args.name!r} not acquired within {args.wait:g} s",
                    file=sys.stderr,
                )
                return EXIT_CONFLICT
            env = dict(os.environ)
            env[LOCK_TOKEN_ENV] = str(lock.token)
            runner = LockedCommand(command, env, kill_grace=args.kill_grace)
            try:
                runner.start()
            except OSError as exc:
                print(f"clone: cannot run {command[0]!r}: {exc}", file=sys.stderr)
                return EXIT_ERROR
            running.append(runner)
        except _Stopped as stopped:
            if runner is None or runner.pid is None:
                return 128 + stopped.signum
            running.append(runner)  # it started just before the signal: pass it on
            runner.signal_group(stopped.signum)
        while True:
            status = runner.wait(0.1)
            if status is not None:
                return status
            if not lock.held:
                print(
                    f"clone: lost the lock {args.name!r} (its lease ran out); stopping the"
                    f" command (SIGTERM, SIGKILL after {args.kill_grace:g} s)",
                    file=sys.stderr,
                )
                runner.stop()
                return EXIT_ERROR
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for started in running:
            started.close()
        lock.release()
