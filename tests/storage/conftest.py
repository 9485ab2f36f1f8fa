"""Fixtures for the storage tests: every Storage opened here is closed after the test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clone.storage import Storage

OpenStorage = Callable[..., Storage]


def upd(key: bytes, seq: int, body: bytes = b"v", uuid: bytes = b"u" * 16,
        props: bytes = b"") -> list[bytes]:
    """The 5 KVPUB frames of one update (an empty body is a delete)."""
    return [key, seq.to_bytes(8, "big"), uuid, props, body]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def open_storage() -> Iterator[OpenStorage]:
    """``open_storage(dir, **kw)`` opens a Storage that is closed at teardown."""
    opened: list[Storage] = []

    def _open(path: str | os.PathLike[str], **kwargs: Any) -> Storage:
        # A long checkpoint interval unless asked: tests decide when the WAL moves.
        kwargs.setdefault("checkpoint_interval", 3600.0)
        storage = Storage.open(path, **kwargs)
        opened.append(storage)
        return storage

    yield _open
    for storage in opened:
        storage.close()
