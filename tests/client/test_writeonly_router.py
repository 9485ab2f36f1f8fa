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


def test_no_server_at_all_fails_every_write_after_dead_after() -> None:
    """Real sockets, nobody listening: not synced, and a write fails with
    NotActive once no heartbeat came for dead_after; close twice is fine."""
    import pytest

    from clone.client.writeonly import WriteOnlyClone
    from clone.errors import NotActive, NotSynced
    from tests.support.ports import free_base_port

    client = WriteOnlyClone([f"tcp://127.0.0.1:{free_base_port()}"], dead_after=0.5)
    try:
        with pytest.raises(NotSynced):
            client.wait_synced(0.2)
        with pytest.raises(NotActive, match=r"no Clone server sent a heartbeat for 0\.5s"):
            client.set_async("/a", b"1").result(30)
        with pytest.raises(ValueError):
            client.set_async("/a", b"")  # would delete: not a load's write
    finally:
        client.close()
    client.close()


def test_every_server_refusing_is_dead_after_server_timeout() -> None:
    router = WriteRouter(2, server_timeout=1.0, dead_after=10.0, started=0.0)
    router.probed(0, refused=True)
    assert not router.dead(2.0)  # server 1 may still be slow, not gone
    router.probed(1, refused=True)
    assert not router.dead(0.9)
    assert router.dead(1.1)  # both refuse: no process listens; no need to wait 10 s


def test_a_heartbeat_or_an_accepted_connection_clears_a_refusal() -> None:
    router = WriteRouter(2, server_timeout=1.0, dead_after=10.0, started=0.0)
    router.probed(0, refused=True)
    router.probed(1, refused=True)
    router.probed(1, refused=False)  # listening (maybe slow): silence rules again
    assert not router.dead(5.0)
    assert router.dead(10.1)
    router.heard(0, 11.0)
    router.tick(12.2)  # silent: no longer current
    router.probed(1, refused=True)
    assert router.current is None and router.refused == [False, True]
    assert not router.dead(12.5)  # server 0 was heard lately, and may come back
