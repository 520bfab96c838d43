"""Chunked pipeline parallelism in time (engine/cluster/conductor/pipeline.py) and the Conductor
placing on prefill groups: the chunking, the pipeline recurrence on a hand-worked case, chunks
that add up to the unchunked prefill, the paper cost model's 128k-token figures, and a long
prompt placed on a group while a short one stays on a single instance."""

from __future__ import annotations

import pytest

from engine.cluster.conductor.conductor import Conductor, ConductorConfig
from engine.cluster.conductor.cost_model import PAPER
from engine.cluster.conductor.pipeline import (
    PipelineShape,
    chunk_times,
    chunks,
    pipelined_prefill_s,
    run_pipeline,
)


def test_chunks_cut_only_what_exceeds_one_chunk():
    assert chunks(10_000, 0, 4096) == [(4096, 0), (4096, 4096), (1808, 8192)]
    assert chunks(4096, 512, 4096) == [(4096, 512)]  # fits: one piece
    assert chunks(5000, 512, 4096) == [(4096, 512), (904, 4608)]
    assert chunks(0, 100, 4096) == []


def test_the_recurrence_on_a_hand_worked_pipeline():
    # Three chunks of 1 s on each of two stages, hops of 0.5 s: stage 0 ends them at 1, 2, 3;
    # stage 1 takes each 0.5 s after: 2.5, 3.5 (its own previous end), 4.5.
    end, free = run_pipeline([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [0.0, 0.0], 0.0)
    assert end == 4.5 and free == [3.0, 4.5]
    # The next request enters at 0 but waits for stage 0 (free at 3): 4, then stage 1 at 4.5+1.
    end2, free2 = run_pipeline([1.0], [0.5], free, 0.0)
    assert end2 == 5.5 and free2 == [4.0, 5.5]


@pytest.mark.parametrize("new, cached", [(131_072, 0), (20_000, 8192), (4096, 0)])
def test_chunks_add_up_to_the_unchunked_prefill(new, cached):
    parts = chunk_times(PAPER.prefill_s, new, cached, 4096)
    assert sum(n for n, _ in parts) == new
    assert sum(t for _, t in parts) == pytest.approx(PAPER.prefill_s(new, cached), rel=1e-12)
    if cached == 0:  # (loading a cached prefix weighs on the first chunks otherwise)
        times = [t for _, t in parts[1:]]
        assert times == sorted(times)  # later chunks attend to more tokens: they cost more


def test_a_group_of_four_under_the_paper_model_at_128k_tokens():
    single = PAPER.prefill_s(131_072, 0)
    ratios = {}
    for stages in (2, 4, 8):
        t, busy = pipelined_prefill_s(PAPER.prefill_s, PAPER.hidden_copy_s, 131_072, 0,
                                      PipelineShape(stages, 4096))  # fmt: skip
        ratios[stages] = t / single
        assert busy == pytest.approx(single / stages, rel=1e-9)  # each stage's share of work
    assert 0.5 < ratios[2] < 0.6  # the ideal 1/N plus the pipeline's fill and drain
    assert ratios[4] <= 0.35  # the target
    assert ratios[8] < ratios[4]
    # One chunk: the stages run one after another, slower than a single instance by the hops.
    t, _ = pipelined_prefill_s(PAPER.prefill_s, PAPER.hidden_copy_s, 2000, 0, PipelineShape(4))
    assert t == pytest.approx(PAPER.prefill_s(2000, 0) + 3 * PAPER.hidden_copy_s(2000))


def make() -> Conductor:
    c = Conductor(ConductorConfig(rejection="none", ttft_slo_s=1e9))
    c.add_instance("D", "decode", kv_capacity_tokens=PAPER.decode_kv_capacity_tokens)
    c.add_instance("single", "prefill")
    c.add_instance("group", "prefill", shape=PipelineShape(4, 4096))
    return c


def block_keys(prefix: str, tokens: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(-(-tokens // PAPER.block_tokens))]


def test_the_conductor_places_long_prompts_on_a_group_and_short_ones_alone():
    c = make()
    long = c.decide("long", block_keys("l", 131_072), 131_072, 0.0)
    assert long.prefill == "group"
    want, busy = pipelined_prefill_s(c.prefill_model.predict, PAPER.hidden_copy_s, 131_072, 0,
                                     PipelineShape(4, 4096))  # fmt: skip
    assert long.est_ttft_s == pytest.approx(want)
    # The group's queue holds what each stage does for it, not the pipelined time.
    assert c.prefill_queue_s("group", 0.0) == pytest.approx(busy)
    short = c.decide("short", block_keys("s", 1000), 1000, 0.0)
    assert short.prefill == "single"


@pytest.mark.parametrize("shape, trains", [(PipelineShape(4, 4096), False),
                                           (PipelineShape(), True)])  # fmt: skip
def test_only_single_instances_train_the_prefill_model(shape, trains):
    """The fitted model times a whole prefill on one instance; a group's time derives from it."""
    c = Conductor(ConductorConfig(rejection="none", ttft_slo_s=1e9))
    c.add_instance("D", "decode", kv_capacity_tokens=PAPER.decode_kv_capacity_tokens)
    c.add_instance("P", "prefill", shape=shape)
    for i in range(20):  # more than the model's min_samples
        assert c.decide(f"r{i}", block_keys(f"r{i}-", 8192), 8192, float(i)).prefill == "P"
        c.on_prefill_done(f"r{i}", i + 0.5, seconds=0.5, cached_tokens=0)
        c.on_request_finished(f"r{i}", i + 0.5)
    assert c.prefill_model.fitted is trains


def test_only_prefill_instances_form_groups():
    c = Conductor()
    with pytest.raises(ValueError, match="only prefill instances form pipeline groups"):
        c.add_instance("D", "decode", shape=PipelineShape(2))
    with pytest.raises(ValueError, match="stages must be >= 1"):
        PipelineShape(0)
