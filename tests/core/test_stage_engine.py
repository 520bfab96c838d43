"""Engines running one pipeline stage each (EngineConfig.stage, engine/core/stage_io.py), chained
in one process through an in-memory StageIO: the last stage's first token and its logprobs equal
the whole model's exactly, chunk after chunk, with prefix hits on the group; a stage never runs
ahead of the rows it has; a prefix a later stage lacks ends the request; stages short of the last
end their requests "stage_done" and keep their full blocks in the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from engines import run_all

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.cache_plan import plan_cache
from engine.core.llm_engine import STAGE_DONE, LLMEngine
from engine.core.scheduler import PREFIX_MISSING
from engine.core.scheduler_output import ScheduledRequest
from engine.core.stage_io import StageIO, parent_request_id
from engine.kvcache.paged_cache import bytes_per_block
from engine.outputs import RequestOutput
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage
from engine.sampling_params import SamplingParams

BUDGET = 64  # tokens per step: a 300-token prompt runs in 5 chunks
NUM_BLOCKS = 64
BLOCK = 16
FIRST = SamplingParams(max_tokens=1, logprobs=5, temperature=0.0)
SEEDED = SamplingParams(max_tokens=1, logprobs=5, temperature=1.0, seed=1234)


def config(stage: PipelineStage = WHOLE_MODEL, **kw) -> EngineConfig:
    return EngineConfig(
        model="default",
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8),
        stage=stage,
        **kw,
    )


@dataclass
class Rows:
    """The input rows one stage holds for a request: prompt positions [start, have)."""

    start: int
    rows: torch.Tensor  # [prompt length - start, hidden]
    have: int


class MemoryStageIO(StageIO):
    """Stage ``index`` of ``pipeline``: its inputs are the rows the stage before handed it
    (``buffers``, by request id); its outputs go to the next stage's buffers, the next stage's
    request is added at the first chunk (starting where this stage started: prefix_exact) and
    its ready_tokens rise with the rows (unless ``pipeline.hold``)."""

    def __init__(self, pipeline: Pipeline, index: int) -> None:
        self.pipeline = pipeline
        self.index = index
        self.buffers: dict[str, Rows] = {}
        self.reads: list[tuple[str, int, int]] = []  # (request id, first, end) of each input

    def inputs(self, order: Sequence[ScheduledRequest]) -> torch.Tensor:
        parts = []
        for s in order:
            req = s.request
            buf = self.buffers[parent_request_id(req.request_id, req.params.n)]  # rid#i: rid's
            a, b = req.num_computed_tokens, req.num_computed_tokens + s.num_tokens
            assert req.ready_tokens is not None and b <= req.ready_tokens, (req, b)
            assert buf.start <= a and b <= buf.have, f"{req} ran ahead of its rows ({buf.have})"
            self.reads.append((req.request_id, a, b))
            parts.append(buf.rows[a - buf.start : b - buf.start])
        return torch.cat(parts)

    def outputs(self, order: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
        nxt = self.pipeline.ios[self.index + 1]
        engine = self.pipeline.engines[self.index + 1]
        offset = 0
        for s in order:
            req = s.request
            rid = req.request_id
            a, b = req.num_computed_tokens, req.num_computed_tokens + s.num_tokens
            rows = hidden[offset : offset + s.num_tokens]
            offset += s.num_tokens
            buf = nxt.buffers.get(rid)
            if buf is None:
                prompt, params = self.pipeline.requests[rid]
                empty = torch.empty(len(prompt) - a, hidden.shape[1], dtype=hidden.dtype)
                buf = nxt.buffers[rid] = Rows(a, empty, a)
                engine.add_request(
                    prompt, params, request_id=rid, ready_tokens=a, prefix_tokens=a,
                    prefix_exact=True,
                )  # fmt: skip
            assert a <= buf.have, "rows arrive in order"
            lo = max(a, buf.have)  # rows it holds already (a recompute) are not taken again
            if b > lo:
                buf.rows[lo - buf.start : b - buf.start] = rows[lo - a :]
                buf.have = b
            if not self.pipeline.hold:
                engine.set_ready_tokens(rid, buf.have)


class Pipeline:
    def __init__(self, n: int) -> None:
        self.ios = [MemoryStageIO(self, i) for i in range(n)]
        self.engines = [
            LLMEngine(config(PipelineStage(i, n)), stage_io=io) for i, io in enumerate(self.ios)
        ]
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.hold = False  # True: the rows arrive, ready_tokens stay where they are
        self.count = 0

    def reset(self) -> None:
        for engine in self.engines:
            assert not engine.has_unfinished_requests()
            engine.reset_prefix_cache()
        for io in self.ios:
            io.buffers.clear()
            io.reads.clear()
        self.hold = False

    def add(self, prompt: list[int], params: SamplingParams) -> str:
        self.count += 1
        rid = f"p{self.count}"
        self.requests[rid] = (prompt, params)
        self.engines[0].add_request(prompt, params, request_id=rid)
        return rid

    def step_all(self) -> list[dict[str, RequestOutput]]:
        finals: list[dict[str, RequestOutput]] = [{} for _ in self.engines]
        for k, engine in enumerate(self.engines):
            for o in engine.step():
                if o.finished:
                    finals[k][o.request_id] = o
            engine.check_integrity()
        return finals

    def run(self, prompts: list[list[int]], params: SamplingParams):
        """Each prompt through every stage to the end: per stage, the final outputs in prompt
        order."""
        rids = [self.add(p, params) for p in prompts]
        finals: list[dict[str, RequestOutput]] = [{} for _ in self.engines]
        for _ in range(200):
            if not any(e.has_unfinished_requests() for e in self.engines):
                break
            for k, got in enumerate(self.step_all()):
                finals[k].update(got)
        else:
            raise AssertionError("the pipeline did not finish")
        return [[f[r] for r in rids] for f in finals]


@pytest.fixture(scope="module")
def whole():
    return LLMEngine(config())


@pytest.fixture(scope="module")
def pipe2():
    return Pipeline(2)


@pytest.fixture(scope="module")
def pipe3():
    return Pipeline(3)


@pytest.fixture(scope="module")
def prompts(whole):
    tok = whole.tokenizer
    short = tok.encode("The three laws of thermodynamics are")
    text = "A recipe for pancakes: first, take flour, eggs and milk, then whisk them. "
    long = (tok.encode(text * 40) * 2)[:300]
    assert len(short) < BUDGET and len(long) == 300
    return {"short": short, "long": long}


def run_whole(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, reset: bool = True
):
    """The whole model's final outputs (tests/engines.py's run_all), from an empty prefix
    cache unless ``reset`` is False."""
    if reset:
        engine.reset_prefix_cache()
    return run_all(engine, prompts, params)


def same_first_tokens(got: RequestOutput, want: RequestOutput) -> None:
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 1
        assert g.logprobs == w.logprobs  # exactly: token, logprob and the top 5
        assert g.finish_reason == w.finish_reason == "length"


def all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.kv.block_tables
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    assert not engine.scheduler.has_work and not engine.has_unfinished_requests()


# -- equality with the whole model ----------------------------------------------------------


@pytest.mark.parametrize("which", ["short", "long"])
@pytest.mark.parametrize("params", [FIRST, SEEDED], ids=["greedy", "seeded"])
def test_two_stages_sample_the_whole_models_first_token(whole, pipe2, prompts, which, params):
    pipe2.reset()
    prompt = prompts[which]
    (want,) = run_whole(whole, [prompt], params)
    first, last = pipe2.run([prompt], params)
    same_first_tokens(last[0], want)
    # Stage 1 read exactly stage 0's chunks, as the whole model ran them.
    chunks = [(a, b) for _, a, b in pipe2.ios[1].reads]
    assert chunks == [(a, min(a + BUDGET, len(prompt))) for a in range(0, len(prompt), BUDGET)]
    assert first[0].outputs[0].finish_reason == STAGE_DONE
    for engine in pipe2.engines:
        all_free(engine)


def test_n_choices_on_the_last_stage_read_their_parents_rows(whole, pipe2, prompts):
    pipe2.reset()
    params = SamplingParams(n=3, max_tokens=1, logprobs=2, temperature=1.0, seed=99)
    (want,) = run_whole(whole, [prompts["short"]], params)
    first, last = pipe2.run([prompts["short"]], params)
    # Not bit for bit: stage 0 runs the prompt once (6 rows) where the whole model runs it once
    # per choice (18 rows), and the GEMMs' sums differ with the batch's shape (the whole model
    # with n=1 and the same seed differs from itself with n=3 in the same way).
    for g, w in zip(last[0].outputs, want.outputs, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
        (glp,), (wlp,) = g.logprobs, w.logprobs
        assert glp.token_id == wlp.token_id and glp.top.keys() == wlp.top.keys()
        assert glp.logprob == pytest.approx(wlp.logprob, abs=1e-4)
    assert len(first[0].outputs) == 1  # a stage short of the last runs the prompt once
    children = {f"p{pipe2.count}#{i}" for i in range(3)}
    assert {rid for rid, _, _ in pipe2.ios[1].reads} == children


def test_three_stages_sample_the_whole_models_first_token(whole, pipe3, prompts):
    pipe3.reset()
    batch = [prompts["long"], prompts["short"]]
    for params in (FIRST, SEEDED):
        want = run_whole(whole, batch, params)
        outs = pipe3.run(batch, params)
        for got, w in zip(outs[-1], want, strict=True):
            same_first_tokens(got, w)
        for stage_outs in outs[:-1]:
            assert [o.outputs[0].finish_reason for o in stage_outs] == [STAGE_DONE] * 2
            assert all(o.outputs[0].token_ids == [] for o in stage_outs)
        pipe3.reset()
    for engine in pipe3.engines:
        all_free(engine)


def test_a_prefix_hit_on_the_group_computes_only_the_rest(whole, pipe2, prompts, whole_prefix):
    pipe2.reset()
    system, a, b = whole_prefix
    pipe2.run([a], FIRST)
    outs = pipe2.run([b], FIRST)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    cached = (common // BLOCK) * BLOCK
    for (o,) in outs:
        assert o.metrics.num_cached_tokens == cached > 0
        assert o.metrics.num_computed_prompt_tokens == len(b) - cached
    assert pipe2.ios[1].reads[-1][1:] == (cached, len(b))  # from the prefix on, nothing before
    run_whole(whole, [a], FIRST)
    (want,) = run_whole(whole, [b], FIRST, reset=False)  # the same hit and chunks
    assert want.metrics.num_cached_tokens == cached
    same_first_tokens(outs[-1][0], want)


@pytest.fixture(scope="module")
def whole_prefix(whole):
    tok = whole.tokenizer
    system = tok.encode("You are a careful assistant who answers briefly. " * 10)
    assert len(system) > 5 * BLOCK
    a = system + tok.encode("Question: what is the boiling point of water?")
    b = system + tok.encode("Question: name three prime numbers.")
    return system, a, b


# -- the stage seam's rules -----------------------------------------------------------------


def test_the_last_stage_stops_at_the_first_token_until_handed_over(pipe2, prompts):
    pipe2.reset()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    rid = pipe2.add(prompts["short"], params)
    first, last = pipe2.engines
    for _ in range(3):
        pipe2.step_all()
    (req,) = last.requests_of(rid)
    assert req.num_output_tokens == 1 and not req.is_finished  # no decode on a stage
    assert last.step() == []
    assert last.hand_over(rid)
    (out,) = last.step()
    assert out.finished and out.outputs[0].finish_reason == "handed_over"
    assert len(out.outputs[0].token_ids) == 1
    for engine in pipe2.engines:
        all_free(engine)


def test_a_missing_prefix_ends_the_request_and_frees_everything(pipe2, prompts):
    pipe2.reset()
    last = pipe2.engines[1]
    free = last.kv.pool.num_free
    prompt = prompts["long"]
    rid = last.add_request(
        prompt, FIRST, request_id="miss", ready_tokens=2 * BLOCK, prefix_tokens=2 * BLOCK,
        prefix_exact=True,
    )  # fmt: skip
    (out,) = last.step()
    assert out.request_id == rid and out.finished
    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].stop_reason == PREFIX_MISSING == "prefix_missing"
    assert out.outputs[0].token_ids == []
    assert last.metrics.finished.get("abort", 0) >= 1
    assert last.kv.pool.num_free == free
    all_free(last)
    assert last.step() == []  # nothing left behind


def test_prefix_exact_rules_are_checked(pipe2, prompts):
    last = pipe2.engines[1]
    prompt = prompts["short"]
    for kw, message in [
        ({"prefix_exact": True}, "prefix_exact needs prefix_tokens"),
        ({"prefix_exact": True, "prefix_tokens": 5}, "a multiple of the block size"),
        ({"ready_tokens": len(prompt) + 1}, "ready_tokens"),
        ({"prefix_tokens": -1}, "prefix_tokens must be None or an int >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            last.add_request(prompt, FIRST, **kw)
    assert not last.has_unfinished_requests()


def test_a_later_stage_never_runs_ahead_of_its_rows(pipe2, prompts):
    pipe2.reset()
    pipe2.hold = True
    first, last = pipe2.engines
    long, short = prompts["long"], prompts["short"]
    rid = pipe2.add(long, FIRST)
    while first.has_unfinished_requests():
        first.step()
    assert pipe2.ios[1].buffers[rid].have == len(long)  # every row arrived ...
    (req,) = last.requests_of(rid)
    assert req.ready_tokens == 0  # ... none is ready yet: it stays waiting
    steps = last.num_steps
    assert last.step() == [] and last.num_steps == steps and req.num_computed_tokens == 0
    last.set_ready_tokens(rid, 40)
    last.step()
    assert req.num_computed_tokens == 40 and pipe2.ios[1].reads == [(rid, 0, 40)]
    steps = last.num_steps
    assert last.step() == [] and last.num_steps == steps  # running, nothing ready: skipped
    # A request with its rows ready runs while the first one waits for more.
    other = pipe2.add(short, FIRST)
    first.step()
    last.set_ready_tokens(other, len(short))
    (out,) = last.step()
    assert out.request_id == other and out.finished and len(out.outputs[0].token_ids) == 1
    assert req.num_computed_tokens == 40
    for ready in (41, 100):  # one row, then what is ready
        last.set_ready_tokens(rid, ready)
        assert last.step() == [] and req.num_computed_tokens == ready
    last.set_ready_tokens(rid, len(long))
    while last.has_unfinished_requests():
        outs = last.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    reads = [(a, b) for r, a, b in pipe2.ios[1].reads if r == rid]
    assert reads[:3] == [(0, 40), (40, 41), (41, 100)] and reads[-1][1] == len(long)
    for engine in pipe2.engines:
        all_free(engine)


def test_a_stage_short_of_the_last_ends_stage_done_and_keeps_its_prefix(pipe2, prompts):
    pipe2.reset()
    first = pipe2.engines[0]
    before = first.metrics.finished.get(STAGE_DONE, 0)
    prompt = prompts["long"]
    outs = pipe2.run([prompt], FIRST)
    (done,) = outs[0]
    assert done.finished and done.outputs[0].finish_reason == STAGE_DONE
    assert done.outputs[0].token_ids == [] and done.metrics.num_computed_prompt_tokens == 300
    assert first.metrics.finished[STAGE_DONE] == before + 1
    counts = first.kv.pool.counts()
    assert counts.used == 0 and counts.cached == len(prompt) // BLOCK
    all_free(first)


# -- construction -----------------------------------------------------------------------------


def test_a_stages_cache_holds_its_layers_only(pipe3, whole):
    layers = whole.model_config.num_layers
    total = 0
    for engine in pipe3.engines:
        n = len(engine.stage.layer_range(layers))
        assert engine.cache.kv.shape[0] == n == len(engine.model.layers)
        per_block = bytes_per_block(engine.model_config, BLOCK, torch.float32, n)
        assert per_block == engine.cache.kv[:, :, 0].numel() * 4
        total += n
    assert total == layers == whole.cache.kv.shape[0]
    # A stage's KV budget in blocks counts its layers: half the layers, twice the blocks.
    budget = EngineConfig(cache=CacheConfig(kv_cache_memory_gb=0.1), max_model_len=512)
    cfg, cpu = whole.model_config, torch.device("cpu")
    all_layers = plan_cache(budget, cfg, torch.float32, cpu).num_blocks
    half = plan_cache(budget, cfg, torch.float32, cpu, num_layers=layers // 2).num_blocks
    assert half == 2 * all_layers or half == 2 * all_layers + 1


def test_stage_settings_are_checked(pipe2):
    with pytest.raises(ValueError, match="stage must be a PipelineStage, got '0/2'"):
        EngineConfig(stage="0/2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline stages run without a KV pool"):
        EngineConfig(stage=PipelineStage(0, 2), kv_pool="dram=1GiB")
    with pytest.raises(ValueError, match="stage_io is required for pipeline stage 1/2"):
        LLMEngine(config(PipelineStage(1, 2)))
    for engine in pipe2.engines:
        with pytest.raises(ValueError, match="prompt_logprobs are not served by pipeline stages"):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=1))
        with pytest.raises(ValueError, match="prompt_logits needs the whole model"):
            engine.prompt_logits([1, 2, 3])
