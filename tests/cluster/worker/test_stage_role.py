"""A later stage's role between its link and its engine (stage_role.py), in one process: a
request waits outside the engine until the stage before's first rows come, then joins it at
exactly that start (prefix_exact) with its ready rows; rows that come later raise its readiness;
hidden states that fail (a bad frame, the stage before's abort, the deadline) end the attempt
with a 503 to the router and leave nothing held (engine, KV sender, rows). Real engine of stage
1/2 of the default model, a stub link receiver and KV sender (no sockets)."""

from __future__ import annotations

import pytest
import torch

from engine.cluster import messages as m
from engine.cluster.transfer.staging import KVLayout
from engine.cluster.worker.stage_role import LinkIO, StageRole
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.ipc.wire import params_to_wire
from engine.pipeline_stage import PipelineStage
from engine.sampling_params import SamplingParams

STAGE = PipelineStage(1, 2)
PROMPT = list(range(100, 260))  # 160 tokens: 3 chunks of 64


class StubReceiver:
    """What HiddenReceiver tells the role, set by the test."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.streams: dict[str, dict] = {}
        self.released: list[str] = []

    def expect(self, rid: str, num_tokens: int, deadline_s: float) -> None:
        self.streams[rid] = {"n": num_tokens, "first": None, "ready": 0, "error": None}

    def first_start(self, rid: str):
        return self.streams[rid]["first"]

    def ready(self, rid: str) -> int:
        return self.streams[rid]["ready"]

    def error(self, rid: str):
        return self.streams[rid]["error"]

    def rows(self, rid: str, start: int, end: int) -> torch.Tensor:
        return torch.zeros(end - start, self.hidden)

    def expire(self, now: float) -> list[str]:
        return []

    def release(self, rid: str) -> None:
        self.released.append(rid)
        self.streams.pop(rid, None)

    @property
    def used_bytes(self) -> int:
        return 0


class StubSender:
    """The KV sender's calls the role makes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.num_layers, self.layers = engine.model_config.num_layers, engine.cache.layers
        cfg = engine.model_config
        self.token_bytes = cfg.num_kv_heads * cfg.head_dim * 4
        self.targets: dict[str, object] = {}
        self.cancelled: list[str] = []

    def add(self, target) -> None:
        self.targets[target.request_id] = target

    def cancel(self, rid: str, reason: str) -> None:
        self.cancelled.append(rid)
        self.targets.pop(rid, None)

    def finish(self, rid: str, done) -> float:
        self.targets.pop(rid, None)
        return 0.0


@pytest.fixture(scope="module")
def engine():
    link = LinkIO(STAGE)
    cfg = EngineConfig(
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=64, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        stage=STAGE,
    )
    e = LLMEngine(cfg, stage_io=link)
    e.test_link = link
    return e


@pytest.fixture
def role(engine):
    link = engine.test_link
    link.receiver = StubReceiver(engine.model_config.hidden_size)
    out: list[m.Message] = []
    r = StageRole(engine, StubSender(engine), link, "g-1", out.append)
    r.out = out
    yield r
    for rid in list(r.active) + list(r.waiting):
        r.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def prefill_request(engine, rid: str, prompt: list[int] = PROMPT) -> m.PrefillRequest:
    sender = StubSender(engine)
    nbytes = KVLayout(sender.num_layers, len(prompt), sender.token_bytes).nbytes
    params = params_to_wire(SamplingParams(max_tokens=1, temperature=0.0))
    return m.PrefillRequest(rid, prompt, params, "d0", "tcp://127.0.0.1:1", "tcp", "", 0, nbytes)


def test_a_request_joins_the_engine_at_the_first_rows_start_and_follows_its_rows(engine, role):
    rx = role.link.receiver
    role.handle(prefill_request(engine, "r"))
    assert "r" in role.waiting and not engine.requests_of("r")  # no rows yet
    rx.streams["r"].update(first=0, ready=64)
    role.on_hidden("r")
    (req,) = engine.requests_of("r")
    assert (req.prefix_tokens, req.prefix_exact, req.ready_tokens) == (0, True, 64)
    assert "r" in role.sender.targets  # its KV streams to the decode worker
    engine.step()
    assert req.num_computed_tokens == 64
    engine.step()  # nothing more is ready: it waits
    assert req.num_computed_tokens == 64
    rx.streams["r"]["ready"] = 160
    role.on_hidden("r")
    assert req.ready_tokens == 160
    while req.num_output_tokens == 0:
        engine.step()
    role.after_step([])
    assert not role.active and "r" in rx.released  # handed over: its rows are let go
    assert [x for x in role.out if isinstance(x, m.Outputs)]


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_hidden_states_that_fail_end_the_attempt_and_hold_nothing(engine, role, when):
    rx = role.link.receiver
    role.handle(prefill_request(engine, "f"))
    if when == "running":
        rx.streams["f"].update(first=0, ready=64)
        role.on_hidden("f")
        engine.step()
    rx.streams["f"]["error"] = "checksum mismatch in rows [64, 128)"
    role.on_hidden("f")
    (err,) = [x for x in role.out if isinstance(x, m.RequestError)]
    assert err.code == 503 and "checksum mismatch" in err.message  # placed again elsewhere
    assert not engine.requests_of("f") and "f" in rx.released
    assert not role.num_requests and "f" not in role.sender.targets


def test_a_stage_without_the_first_stages_prefix_says_so(engine, role):
    rx = role.link.receiver
    role.handle(prefill_request(engine, "p", [p + 7 for p in PROMPT]))  # never computed here
    rx.streams["p"].update(first=64, ready=128)  # stage 0 found 64 tokens cached; not here
    role.on_hidden("p")
    engine.step()
    role.after_step([])
    (err,) = [x for x in role.out if isinstance(x, m.RequestError)]
    assert err.code == 503 and "prefix is not in this stage's cache" in err.message
    assert not role.num_requests and "p" in rx.released and "p" in role.sender.cancelled
