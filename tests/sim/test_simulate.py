"""The cluster simulator: deterministic, exact at zero load, every request ends exactly once, and it
runs the very Conductor and eviction policies the engine ships."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import engine.cluster.conductor.adapter as conductor_placement
import engine.cluster.conductor.conductor as conductor_mod
import engine.kvstore.eviction as eviction_mod
from engine.cluster.conductor.cost_model import PAPER, SMOLLM2_CPU
from engine.sim import simulate, simulator
from engine.sim.simulator import SimConfig, Simulator
from engine.sim.trace import TraceRequest, load_trace


def synthetic(n: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Chat-like requests: a few shared system prompts, conversations that grow turn by turn."""
    rng = random.Random(seed)
    out, t, next_id = [], 0.0, 1000
    convs: list[tuple[int, ...]] = []
    for i in range(n):
        t += rng.expovariate(rate)
        if convs and rng.random() < 0.5:
            j = rng.randrange(len(convs))
            ids = convs[j] + tuple(range(next_id, next_id + rng.randint(1, 4)))
            convs[j] = ids
        else:
            ids = (rng.randrange(3),) + tuple(range(next_id, next_id + rng.randint(2, 30)))
            convs.append(ids)
        next_id += 100
        n_in = len(ids) * 512 - rng.randrange(512)
        out.append(TraceRequest(i, t, n_in, rng.randint(1, 400), ids))
    return out


def write_trace(path, reqs: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in reqs:
            rec = {
                "timestamp": int(r.arrival_s * 1000),
                "input_length": r.input_len,
                "output_length": r.output_len,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(rec) + "\n")


def run(cfg: SimConfig, reqs) -> tuple[Simulator, dict]:
    sim = Simulator(cfg, reqs)
    return sim, sim.run()


def strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "wall_s"}


def test_it_runs_the_engines_conductor_and_eviction_policies():
    # Forking the Conductor (or the policies) into the simulator would make its results say
    # nothing about the cluster: it must use the very classes.
    assert simulator.Conductor is conductor_mod.Conductor
    assert conductor_placement.Conductor is conductor_mod.Conductor  # what the router wraps
    sim = Simulator(SimConfig(prefill=2, decode=1, eviction="lfu"), [])
    assert type(sim.conductor) is conductor_mod.Conductor
    assert type(sim.prefills["p0"].cache.policy) is eviction_mod.LfuPolicy


@pytest.mark.parametrize("policy", ["random", "kvcentric"])
def test_deterministic_for_a_seed(policy):
    reqs = synthetic(300, rate=6.0)
    cfg = SimConfig(prefill=3, decode=2, policy=policy, seed=7)
    a, b = run(cfg, reqs)[1], run(cfg, reqs)[1]
    assert strip(a) == strip(b)
    if policy == "random":
        other = run(SimConfig(prefill=3, decode=2, policy=policy, seed=8), reqs)[1]
        assert strip(other) != strip(a)


@pytest.mark.parametrize("cost", [PAPER, SMOLLM2_CPU], ids=lambda c: c.name)
def test_zero_load_ttft_and_tbt_are_the_cost_models(cost):
    first = TraceRequest(0, 0.0, 5 * 512 + 100, 50, (1, 2, 3, 4, 5, 6))
    # Arrives long after the first is done; shares its first four blocks.
    second = TraceRequest(1, 1000.0, 7 * 512, 20, (1, 2, 3, 4, 70, 71, 72))
    # SLOs out of the way: a CPU model misses the paper's (its decode step is over 100 ms).
    cfg = SimConfig(prefill=2, decode=2, cost_model=cost.name, ttft_slo_s=1e3, tbt_slo_s=10.0)
    sim, res = run(cfg, [first, second])
    assert res["completed"] == 2
    assert sim.ttft["0"] == pytest.approx(cost.prefill_s(first.input_len, 0), rel=1e-12)
    cached = 4 * 512
    assert sim.ttft["1"] == pytest.approx(cost.prefill_s(7 * 512 - cached, cached), rel=1e-12)
    # Alone on its decode instance: every interval after the first is one step of batch 1.
    ivs = sim.intervals["0"]
    assert len(ivs) == first.output_len - 1
    steps = [cost.decode_step_s(1, first.input_len + i) for i in range(1, len(ivs))]
    np.testing.assert_allclose(ivs[1:], steps, rtol=1e-9)
    # The first interval: the streamed tail of the KV, then the first step.
    tail = cost.stream_tail_s(first.input_len)
    assert ivs[0] == pytest.approx(tail + cost.decode_step_s(1, first.input_len), rel=1e-9)


@pytest.mark.parametrize("rejection", ["none", "early", "predicted"])
def test_every_request_ends_exactly_once_under_overload(rejection):
    reqs = synthetic(400, rate=40.0, seed=3)  # far beyond 2 prefill instances
    cfg = SimConfig(prefill=2, decode=1, rejection=rejection, ttft_slo_s=5.0, tbt_slo_s=0.03)
    sim, res = run(cfg, reqs)
    assert sorted(sim.outcome, key=int) == [str(r.index) for r in reqs]  # each exactly once
    assert res["completed"] + res["rejected"] == len(reqs)
    assert res["rejected"] > 0 and res["completed"] > 0
    assert res["rejected_at_arrival"] + res["rejected_after_prefill"] == res["rejected"]
    # Nothing left behind in the Conductor or on the instances.
    assert sim.conductor.placed() == 0
    for d in sim.decodes.values():
        assert d.running == d.reserved == d.ctx == 0 and not d.waiting
    for p in sim.prefills.values():
        assert p.job is None and not p.queue


def test_a_global_pool_is_a_copy_source():
    # Every prefill writes its blocks to the pool; the Conductor hears the pool's events and
    # may copy from it. Requests still end exactly once.
    reqs = synthetic(300, rate=8.0, seed=5)
    sim, res = run(SimConfig(prefill=3, decode=2, pool_blocks=500, cache_blocks=40), reqs)
    assert res["completed"] + res["rejected"] == len(reqs)
    assert sim.conductor.index.count("pool") == len(sim.pool.policy) > 0
    assert res["copied_blocks"] > 0


def test_colocated_prefill_stalls_the_running_decode():
    a = TraceRequest(0, 0.0, 1024, 200, (1, 2))
    b = TraceRequest(1, 1.0, 60 * 512, 5, tuple(range(10, 70)))  # arrives while a decodes
    sim, res = run(SimConfig(colocated=1, ttft_slo_s=1e9, tbt_slo_s=1e9), [a, b])
    assert res["completed"] == 2
    stall = PAPER.prefill_s(b.input_len, 0)
    assert sim.intervals["0"].max() >= stall  # a's interval spanning b's prefill
    assert sim.tbt["0"] > 0.1  # misses a 100 ms TBT SLO; disaggregated it would not
    _, disagg = run(SimConfig(prefill=1, decode=1), [a, b])
    assert disagg["tbt_p90_s"] < 0.1


def test_cli_prints_one_json_object(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(path, synthetic(120, rate=5.0))
    assert load_trace(path, speed=2.0)[-1].arrival_s == pytest.approx(
        int(synthetic(120, rate=5.0)[-1].arrival_s * 1000) / 2000
    )
    rc = simulate.main(
        [
            "--trace",
            str(path),
            "--prefill",
            "2",
            "--decode",
            "2",
            "--policy",
            "kvcentric",
            "--rejection",
            "predicted",
            "--speed",
            "1.0",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "ttft_mean_s",
        "ttft_p90_s",
        "tbt_p90_s",
        "rejected",
        "completed",
        "cache_hit_rate",
    ):
        assert key in out
    assert out["completed"] + out["rejected"] == 120
    assert 0 < out["cache_hit_rate"] < 1
    assert simulate.main(["--trace", str(path), "--speed", "0"]) == 2
    assert "speed must be > 0" in capsys.readouterr().err


def group_config(stages: int = 4, prefill: int = 0) -> SimConfig:
    return SimConfig(prefill=prefill, prefill_groups=1, stages=stages, decode=1,
                     rejection="none", ttft_slo_s=float("inf"))  # fmt: skip


def test_a_prefill_group_pipelines_chunks_and_the_next_prompt():
    from engine.cluster.conductor.pipeline import PipelineShape, run_pipeline, stage_plan

    n = 65_536
    a = TraceRequest(0, 0.0, n, 2, tuple(range(0, 128)))
    b = TraceRequest(1, 0.0, n, 2, tuple(range(1000, 1128)))  # at once, nothing shared
    sim, res = run(group_config(), [a, b])
    assert res["completed"] == 2
    per, hops = stage_plan(PAPER.prefill_s, PAPER.hidden_copy_s, n, 0, PipelineShape(4, 4096))
    end_a, free = run_pipeline(per, hops, [0.0] * 4, 0.0)
    end_b, _ = run_pipeline(per, hops, free, 0.0)
    assert sim.ttft["0"] == pytest.approx(end_a, rel=1e-12)
    # The second enters once stage 0 is free, not once the first left the last stage.
    assert sim.ttft["1"] == pytest.approx(end_b, rel=1e-12)
    assert end_b < 2 * end_a
    assert end_a < PAPER.prefill_s(n, 0) / 2  # four stages beat one instance


def test_groups_and_single_instances_side_by_side():
    long = TraceRequest(0, 0.0, 131_072, 2, tuple(range(256)))
    short = TraceRequest(1, 1e5, 900, 2, (5000, 5001))
    sim, res = run(group_config(prefill=1), [long, short])
    assert res["completed"] == 2
    assert sim.ttft["0"] < PAPER.prefill_s(131_072, 0) * 0.35  # the group took it
    assert sim.ttft["1"] == pytest.approx(PAPER.prefill_s(900, 0), rel=1e-9)  # a single one


def test_group_settings_are_checked():
    with pytest.raises(ValueError, match="need a prefill instance or group"):
        SimConfig(prefill=0, decode=1)
    with pytest.raises(ValueError, match="stages must be >= 2 in a prefill group"):
        SimConfig(prefill_groups=1, stages=1)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        SimConfig(prefill_groups=1, chunk_tokens=0)


def test_cli_long_prompts(capsys):
    argv = ["--prefill", "0", "--prefill-groups", "1", "--stages", "4", "--decode", "1",
            "--long-prompts", "16384,131072", "--json"]  # fmt: skip
    assert simulate.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["long_prompts"]) == {"16384", "131072"}
    assert out["long_prompts"]["131072"] < 0.35 * PAPER.prefill_s(131_072, 0)
    assert simulate.main(["--long-prompts", "12,x"]) == 2
    assert "comma-separated token counts" in capsys.readouterr().err
