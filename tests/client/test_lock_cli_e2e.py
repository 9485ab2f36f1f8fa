"""``clone lock NAME -- COMMAND`` as a shell user runs it: real ``clone``
processes against real servers, each running a small command that records,
in its own file, when it started and ended (``time.monotonic_ns``, one clock
for every process of the machine) and whether it got SIGTERM.

Promised (docs/client.md, "The `clone` command"): the command runs only while
the lock is held, ``clone lock`` exits with the command's exit code, and when
the lock is lost while the command runs (its lease no longer valid) the
command gets SIGTERM and ``clone lock`` exits 4 with a message.
"""

from __future__ import annotations

import pytest

from clone.client.cli import _lock_command, _parser


def test_options_after_the_name_are_the_locks_not_the_commands() -> None:
    """The documented order, ``clone lock NAME --ttl S --wait S -- COMMAND``."""
    cases = {
        ("/l", "--ttl", "1", "--wait", "2", "--", "cmd", "-x"): (1.0, 2.0, ["cmd", "-x"]),
        ("--ttl", "1", "/l", "--", "cmd", "--", "y"): (1.0, None, ["cmd", "--", "y"]),
        ("/l", "--", "cmd", "--ttl", "3"): (5.0, None, ["cmd", "--ttl", "3"]),
        ("/l", "cmd", "-x", "--", "y"): (5.0, None, ["cmd", "-x", "--", "y"]),
    }
    for argv, (ttl, wait, command) in cases.items():
        args = _parser().parse_args(["lock", *argv])
        assert _lock_command(args) == command  # first: it reads the lock's options
        assert (args.name, args.ttl, args.wait) == ("/l", ttl, wait)
    for bad in (("/l", "--ttl", "1", "cmd"), ("/l", "--bogus", "--", "cmd")):
        with pytest.raises(SystemExit) as usage:
            _lock_command(_parser().parse_args(["lock", *bad]))
        assert usage.value.code == 2
