"""The KV-connector seam on the real default model: prefixes loaded from outside the paged cache
give the same greedy tokens as a full recompute, only the tail runs, failed and partial loads fall
back to recompute, a request aborted while loading frees its blocks, and a per-layer saver sees
every layer of every step in order."""

from __future__ import annotations

import threading

import pytest
from engines import GREEDY, make_engine, run_all

from engine.core.request import RequestStatus
from engine.kv_connector.base import KVConnector, LoadDone
from engine.kv_connector.pool import PoolConnector

PROMPT = list(range(1000, 1000 + 150))  # 9 full blocks of 16 and a tail of 6


class MemoryStore:
    """The BlockStore interface over a dict; ``fail_after`` blocks reads after that many hits and
    ``gate`` holds reads until set."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.fail_after: int | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0

    def match(self, keys):
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def get_into(self, key, out):
        self.gate.wait(10)
        failing = self.fail_after is not None and self.reads >= self.fail_after
        if key not in self.blocks or failing:
            return None
        self.reads += 1
        out[:] = self.blocks[key]
        return "dram"

    def put(self, key, data, position=0):
        self.blocks[key] = bytes(data)
        return True

    def stats(self):
        return {"dram": {"blocks": len(self.blocks)}}

    def close(self):
        pass


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of PROMPT computed in full, with no connector."""
    engine = make_engine(prefix=False)
    return run_all(engine, [PROMPT])[0].outputs[0].token_ids


def pooled_engine():
    store = MemoryStore()
    engine = make_engine(
        connector_factory=lambda cache, inner: PoolConnector(store, cache.kv, cache.block_size)
    )
    return engine, store, engine.connector


def test_prefix_loaded_from_pool_matches_recompute(reference):
    engine, store, conn = pooled_engine()
    first = run_all(engine, [PROMPT])[0]
    assert first.outputs[0].token_ids == reference
    assert first.metrics.num_computed_prompt_tokens == len(PROMPT)
    assert conn.flush()
    assert len(store.blocks) >= 9  # the prompt's 9 full blocks (and full output blocks)

    assert engine.reset_prefix_cache() > 0  # the device cache forgets; the pool remembers
    second = run_all(engine, [PROMPT])[0]
    assert second.outputs[0].token_ids == reference
    m = second.metrics
    assert m.num_cached_tokens == 144 and m.kv_sources == {"dram": 144}
    assert m.num_computed_prompt_tokens == len(PROMPT) - 144  # only the tail ran
    engine.check_integrity()

    # A third run hits the device cache again (the loaded blocks were named there).
    third = run_all(engine, [PROMPT])[0]
    assert third.outputs[0].token_ids == reference
    assert third.metrics.kv_sources == {"device": 144}
    engine.close()


@pytest.mark.parametrize("fail_after", [0, 4])
def test_failed_load_recomputes(reference, fail_after):
    engine, store, conn = pooled_engine()
    run_all(engine, [PROMPT])
    conn.flush()
    engine.reset_prefix_cache()
    store.fail_after, store.reads = fail_after, 0
    out = run_all(engine, [PROMPT])[0]
    assert out.outputs[0].token_ids == reference
    assert out.metrics.num_cached_tokens == fail_after * 16
    assert out.metrics.num_computed_prompt_tokens == len(PROMPT) - fail_after * 16
    assert conn.counters["failed_loads"] == 1
    assert engine.scheduler.num_failed_loads == 1
    engine.close()


def test_abort_while_loading_frees_blocks(reference):
    engine, store, conn = pooled_engine()
    run_all(engine, [PROMPT])
    conn.flush()
    engine.reset_prefix_cache()
    store.gate.clear()  # reads hang: the request stays in LOADING_KV
    rid = engine.add_request(PROMPT, GREEDY)
    for _ in range(3):
        assert engine.step() == []
    req = engine.scheduler.loading[rid]
    assert req.status is RequestStatus.LOADING_KV
    assert engine.kv.block_tables[rid]  # holds its blocks while loading
    engine.abort_request(rid)
    engine.step()
    assert not engine.scheduler.loading and rid not in engine.kv.block_tables
    engine.check_integrity()
    store.gate.set()
    assert engine.kv.pool.counts().used == 0
    # The engine keeps serving, and the aborted load never lands in reused blocks.
    assert run_all(engine, [PROMPT])[0].outputs[0].token_ids == reference
    engine.close()


class LayerRecorder(KVConnector):
    """A per-layer saver that loads nothing and records what it was shown."""

    per_layer = True

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[tuple[str, int]]]] = []
        self.saved: list[tuple[str, int, int]] = []

    def lookup(self, req, block_hashes, num_device_tokens):
        return 0

    def start_load(self, req, block_table, start_token, num_tokens):
        raise AssertionError("nothing to load")

    def finished_loads(self) -> list[LoadDone]:
        return []

    def save(self, req, block_table, block_hashes, first_block, num_blocks):
        self.saved.append((req.request_id, first_block, num_blocks))

    def save_layer(self, layer, step):
        self.calls.append((layer, [(s.request.request_id, len(s.slots)) for s in step]))


def test_per_layer_save_sees_every_layer_and_full_blocks():
    rec = LayerRecorder()
    # 150 prompt tokens: chunks of 64, 64, 22
    engine = make_engine(max_tokens=64, connector_factory=lambda cache, inner: rec)
    rid = engine.add_request(PROMPT, GREEDY)
    engine.step()
    layers = engine.model_config.num_layers
    assert [c[0] for c in rec.calls] == list(range(layers))
    assert all(c[1] == [(rid, 64)] for c in rec.calls)
    while engine.has_unfinished_requests():
        engine.step()
    # Full blocks handed over exactly once each, in order: 4 + 4 + 1 from the prompt chunks,
    # then one more after 10 output tokens fill block 10 (150 + 10 = 160).
    assert rec.saved == [(rid, 0, 4), (rid, 4, 4), (rid, 8, 1), (rid, 9, 1)]


class CountingConnector(KVConnector):
    """Loads nothing; counts every call the scheduler and the step loop make, and wraps the
    engine's pool connector (``inner``) as a cluster worker's connector does."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def lookup(self, req, block_hashes, num_device_tokens):
        self._count("lookup")
        return 0

    def start_load(self, req, block_table, start_token, num_tokens):
        raise AssertionError("nothing to load")

    def finished_loads(self) -> list[LoadDone]:
        self._count("finished_loads")
        return []

    def save(self, req, block_table, block_hashes, first_block, num_blocks):
        self._count("save")

    def request_finished(self, req):
        self._count("request_finished")

    def stats(self):
        return {"counting": dict(self.calls)}


def test_engine_uses_the_connector_it_was_built_with():
    """The connector passed in at construction is the one the scheduler (lookup, finished
    loads, request_finished) and the step loop (save) call, and the one metrics report."""
    seen = {}

    def factory(cache, inner):
        seen["cache"], seen["inner"] = cache, inner
        return CountingConnector(inner)

    heard = []
    engine = make_engine(
        connector_factory=factory, block_listener=lambda kind, h: heard.append((kind, h))
    )
    conn = engine.connector
    assert isinstance(conn, CountingConnector)
    assert engine.scheduler.connector is conn
    assert seen == {"cache": engine.cache, "inner": None}  # no kv_pool configured
    out = run_all(engine, [PROMPT])[0]
    assert out.finished
    assert conn.calls["lookup"] == 1
    assert conn.calls["request_finished"] == 1
    assert conn.calls["save"] >= 1  # the prompt's full blocks
    assert engine.metrics_snapshot().kv_pool == {"counting": conn.calls}
    assert all(kind in ("stored", "removed") for kind, _ in heard)
    assert sum(kind == "stored" for kind, _ in heard) >= 9  # the prompt's 9 full blocks
    engine.close()
