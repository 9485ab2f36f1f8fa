"""The write-only client's decisions on a fake clock: which server, when the pair is dead."""

from __future__ import annotations

from clone.client.writeonly import WriteRouter


def test_first_server_heard_becomes_current_and_silence_forgets_it() -> None:
    router = WriteRouter(2, server_timeout=1.0, dead_after=10.0, started=0.0)
    assert router.current is None
    assert router.heard(1, 0.2) is True
    assert router.heard(0, 0.3) is False  # a current server is kept
    assert router.current == 1
    router.tick(1.1)
    assert router.current == 1
    router.tick(1.3)  # silent for more than server_timeout
    assert router.current is None
    assert router.heard(0, 1.4) is True and router.current == 0


def test_not_active_reply_drops_the_server() -> None:
    router = WriteRouter(2, server_timeout=1.0, dead_after=10.0, started=0.0)
    router.heard(0, 0.0)
    router.not_active(0)
    assert router.current is None
    assert router.heard(1, 0.1) is True and router.current == 1


def test_dead_only_after_dead_after_without_any_heartbeat() -> None:
    router = WriteRouter(2, server_timeout=1.0, dead_after=10.0, started=0.0)
    assert not router.dead(9.9)
    assert router.dead(10.1)  # never heard since the start
    router.heard(0, 20.0)
    assert not router.dead(29.0)  # a current server is never dead
    router.tick(21.5)
    assert not router.dead(29.9)
    assert router.dead(30.1)  # counted from the last heartbeat of any server
