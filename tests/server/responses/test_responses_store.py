"""The store of responses: bounded, the oldest evicted first, deletable, its size validated."""

from __future__ import annotations

import pytest

from engine.server.responses.store import (
    MAX_STORE_SIZE,
    ResponsesConfig,
    ResponseStore,
    StoredResponse,
)


def _entry(i: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{i}"}, ())


def test_oldest_evicted_first():
    store = ResponseStore(3)
    for i in range(5):
        store.put(f"resp_{i}", _entry(i))
    assert len(store) == 3
    assert store.get("resp_0") is None and store.get("resp_1") is None
    assert [store.get(f"resp_{i}").response["id"] for i in (2, 3, 4)] == [
        "resp_2",
        "resp_3",
        "resp_4",
    ]


def test_delete():
    store = ResponseStore(2)
    store.put("a", _entry(0))
    assert store.delete("a") and store.get("a") is None
    assert not store.delete("a")


def test_size_zero_keeps_nothing():
    store = ResponseStore(0)
    store.put("a", _entry(0))
    assert store.get("a") is None and len(store) == 0


@pytest.mark.parametrize("size", [-1, MAX_STORE_SIZE + 1])
def test_size_validated(size):
    with pytest.raises(ValueError, match=r"store_size must be in \[0, 1000000\]"):
        ResponsesConfig(size)


@pytest.mark.parametrize("command", [["serve"], ["cluster", "--prefill", "1", "--decode", "1"]])
def test_the_command_line_refuses_a_bad_size_before_anything_starts(command, capsys):
    from engine.cli.main import main

    assert main([*command, "--responses-store-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--responses-store-size: responses store_size must be in [0, 1000000], got -1" in err
