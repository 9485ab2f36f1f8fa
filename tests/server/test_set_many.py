"""``set-many`` (issue 29) in the server core, with explicit times: each entry
judged and applied as its own ``set`` (its own sequence and KVPUB, its own
uuid's dedup), the ACL key by key, one reply."""

from __future__ import annotations

from clone.server.core import ServerCore
from clone.server.journal import published
from clone.wire.calls import OP_SET_MANY, Reply, encode_call, encode_set_many
from clone.wire.codec import KVMsg, decode_update, encode_properties


def _uuid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def _batch(
    core: ServerCore,
    entries: list[tuple[int, str, bytes, bytes]],
    *,
    call: int = 900,
    now: float = 1.0,
    can_write: object = None,
) -> tuple[Reply, bool]:
    body = encode_set_many([(_uuid(u), key.encode(), props, value)
                            for u, key, props, value in entries])  # fmt: skip
    reply, after_commit = core.on_call(
        encode_call(OP_SET_MANY, _uuid(call), "", (), body),
        now,
        can_write=can_write,  # type: ignore[arg-type]
        caller="addr:127.0.0.1",
    )
    assert reply is not None
    return reply, after_commit


def _published(core: ServerCore) -> list[tuple[str, int, bytes]]:
    out = []
    for frames in published(core.journal.take()):
        msg = decode_update(frames)
        assert isinstance(msg, KVMsg)
        out.append((msg.key, msg.sequence, msg.body))
    return out


def test_each_entry_is_an_ordinary_update_with_its_own_sequence() -> None:
    core = ServerCore(standalone=True)
    ttl = encode_properties((("ttl", "60"),))
    reply, after_commit = _batch(core, [(1, "/a", b"", b"one"), (2, "/b", ttl, b"two"),
                                        (3, "/a", b"", b"three")])  # fmt: skip
    assert reply.ok and after_commit
    assert reply.sequences == (1, 2, 3) and reply.failures == () and reply.sequence == 3
    # Three KVPUBs, in order, as three single sets would have made them.
    assert _published(core) == [("/a", 1, b"one"), ("/b", 2, b"two"), ("/a", 3, b"three")]
    stored = core.store.get("/a")
    assert stored is not None and stored.body == b"three"
    c = core.counters
    assert c["set_many_calls"] == 1 and c["set_many_entries"] == 3 and c["calls_ok"] == 3


def test_a_resent_batch_applies_nothing_twice_and_says_what_the_first_did() -> None:
    core = ServerCore(standalone=True)
    entries = [(1, "/a", b"", b"one"), (2, "/b", b"", b"two")]
    first, _ = _batch(core, entries)
    _published(core)
    # Resent after a lost reply (a new call uuid, the same entries), with one more.
    again, after_commit = _batch(core, [*entries, (3, "/c", b"", b"new")], call=901, now=2.0)
    assert again.sequences == (*first.sequences, 3)  # type: ignore[misc]
    assert _published(core) == [("/c", 3, b"new")]
    assert after_commit
    assert core.counters["calls_duplicate"] == 2


def test_an_entry_refused_is_refused_alone_with_a_sets_reason() -> None:
    core = ServerCore(standalone=True)
    _batch(core, [(1, "/cas", b"", b"v")])
    _published(core)
    bad_if = encode_properties((("if_sequence", "x"),))
    stale_if = encode_properties((("if_sequence", "7"),))
    split = encode_properties((("split_term", "3"),))
    lease = encode_properties((("lease", "ab" * 16),))
    reply, _ = _batch(core, [
        (10, "/ok1", b"", b"v"),
        (11, "/_clone/lease/" + "ab" * 16, b"", b"v"),
        (12, "/x", bad_if, b"v"),
        (13, "/cas", stale_if, b"v"),
        (14, "/y", split, b"v"),
        (15, "/z", lease, b"v"),
        (16, "/ok2", b"", b"v"),
    ], now=2.0)  # fmt: skip
    assert reply.ok
    assert reply.sequences == (2, 0, 0, 0, 0, 0, 3)
    reasons = {index: why for index, why, _ in reply.failures}
    assert reasons == {1: "reserved", 2: "bad-if-sequence", 3: "conflict", 4: "malformed",
                       5: "unknown-lease"}  # fmt: skip
    assert dict((i, d) for i, _, d in reply.failures)[3] == "1"  # the key's sequence now
    assert [key for key, _, _ in _published(core)] == ["/ok1", "/ok2"]


def test_a_restricted_client_cannot_write_outside_its_prefix_through_a_batch() -> None:
    core = ServerCore(standalone=True)

    def mine(key: bytes) -> bool:
        return key.startswith(b"/fleet/mine/")

    reply, after_commit = _batch(core, [(1, "/fleet/mine/a", b"", b"v"),
                                        (2, "/fleet/theirs/a", b"", b"v"),
                                        (3, "/fleet/mine/b", b"", b"v")],
                                 can_write=mine)  # fmt: skip
    assert reply.status == "refused" and reply.reason == "acl" and not after_commit
    assert "/fleet/theirs/a" in reply.detail
    assert _published(core) == [] and core.store.sequence == 0
    assert core.counters["calls_refused_acl"] == 1
    # All inside its prefix: applied.
    reply, _ = _batch(core, [(1, "/fleet/mine/a", b"", b"v"), (3, "/fleet/mine/b", b"", b"v")],
                      call=901, can_write=mine)  # fmt: skip
    assert reply.ok and reply.sequences == (1, 2)


def test_a_passive_server_refuses_the_whole_batch() -> None:
    core = ServerCore()
    core.become_passive()
    reply, after_commit = _batch(core, [(1, "/a", b"", b"v")])
    assert (reply.status, reply.reason, after_commit) == ("refused", "not-active", False)
    assert core.store.sequence == 0


def test_a_batch_that_does_not_decode_changes_nothing() -> None:
    core = ServerCore(standalone=True)
    body = encode_set_many([(_uuid(1), b"/a", b"", b"v"), (_uuid(2), b"/b", b"", b"v")])
    # The second entry cut short: the first, well formed, is not applied either.
    reply, after_commit = core.on_call(
        encode_call(OP_SET_MANY, _uuid(6), "", (), body[:-1]), 1.0
    )
    assert reply is not None and (reply.status, reply.reason) == ("refused", "malformed")
    assert "entry 1 is cut short" in reply.detail and not after_commit
    assert core.store.sequence == 0 and _published(core) == []
    assert core.counters["calls_invalid"] == 1


def test_a_relay_refuses_a_restricted_callers_batch_key_by_key_before_forwarding() -> None:
    """A relay judges its caller's call before it forwards it (the pair then
    judges the relay's own, wider rights): the same rule, key by key."""
    from clone.security import Rights
    from clone.server.access import call_refusal

    rights = {"writer": Rights(read=(b"",), write=(b"/fleet/mine/",))}

    def judge(keys: list[bytes]) -> str | None:
        body = encode_set_many([(_uuid(i + 1), key, b"", b"v") for i, key in enumerate(keys)])
        frames = encode_call(OP_SET_MANY, _uuid(900), "", (), body)
        return call_refusal(frames, "writer", write_all=set(), admitted={"writer"},
                            rights_of=lambda name: rights[str(name)])  # fmt: skip

    assert judge([b"/fleet/mine/a", b"/fleet/mine/b"]) is None
    why = judge([b"/fleet/mine/a", b"/fleet/theirs/b"])
    assert why is not None and "/fleet/theirs/b" in why


def test_a_batch_over_the_byte_limit_is_refused_for_its_size_and_changes_nothing() -> None:
    from clone.wire.calls import MAX_SET_MANY_BYTES

    core = ServerCore(standalone=True)
    half = b"x" * (MAX_SET_MANY_BYTES // 2)
    body = encode_set_many([(_uuid(1), b"/a", b"", half)]) + encode_set_many(
        [(_uuid(2), b"/b", b"", half)]
    )
    reply, after_commit = core.on_call(encode_call(OP_SET_MANY, _uuid(7), "", (), body), 1.0)
    assert reply is not None and (reply.status, reply.reason) == ("refused", "size")
    assert f"{MAX_SET_MANY_BYTES}-byte limit" in reply.detail and not after_commit
    assert core.store.sequence == 0 and core.counters["calls_refused_size"] == 1
