"""Endpoint spelling shared by ``clone``, ``clone-pipeline`` and ``Clone(...)``."""

from __future__ import annotations

import pytest

from clone.argtypes import normalize_endpoint, normalize_endpoints


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("127.0.0.1:5556", "tcp://127.0.0.1:5556"),
        ("tcp://127.0.0.1:5556", "tcp://127.0.0.1:5556"),
        ("localhost:1", "tcp://localhost:1"),
        ("  db1.internal:5566 ", "tcp://db1.internal:5566"),
        ("[::1]:5556", "tcp://[::1]:5556"),
        ("h:07", "tcp://h:7"),
        ("h:65533", "tcp://h:65533"),  # P+2 = 65535
    ],
)
def test_both_spellings_give_a_tcp_endpoint(given: str, expected: str) -> None:
    assert normalize_endpoint(given) == expected
    assert normalize_endpoint(expected) == expected  # idempotent


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("nohost", "is not of the form [tcp://]host:port"),
        ("", "is not of the form [tcp://]host:port"),
        ("h:", "is not of the form [tcp://]host:port"),
        (":5556", "is not of the form [tcp://]host:port"),
        ("tcp://:5556", "is not of the form [tcp://]host:port"),
        ("h:port", "is not of the form [tcp://]host:port"),
        ("h:-1", "is not of the form [tcp://]host:port"),
        ("h:\u0665", "is not of the form [tcp://]host:port"),  # a non-ASCII digit
        ("tcp://h/x:1", "is not of the form [tcp://]host:port"),
        ("ipc://sock:1", "only tcp:// endpoints are supported"),
        ("udp://h:1", "only tcp:// endpoints are supported"),
        ("tcp://tcp://h:1", "only tcp:// endpoints are supported"),
        ("h:0", "port 0 out of range"),
        ("h:65534", "port 65534 out of range (a CHP base port P uses P..P+2, so 1..65533)"),
    ],
)
def test_anything_else_is_refused_with_the_expected_form(given: str, why: str) -> None:
    with pytest.raises(ValueError) as exc:
        normalize_endpoint(given)
    message = str(exc.value)
    assert message.startswith(f"server {given!r}") and why in message, message


def test_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="must be str, not int"):
        normalize_endpoint(5556)  # type: ignore[arg-type]


def test_lists_and_comma_separated_strings() -> None:
    assert normalize_endpoints("h:1, tcp://g:2,,") == ["tcp://h:1", "tcp://g:2"]
    assert normalize_endpoints(["h:1", " ", "tcp://g:2"]) == ["tcp://h:1", "tcp://g:2"]
    assert normalize_endpoints("") == []
