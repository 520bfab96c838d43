"""The four experiments of ``make reproduce`` (engine/sim/reproduce.py) and the papers' figures
they are set beside.

Each ``exp_*`` takes a ``Runner``, which runs the simulator (engine/sim/simulator.py) on the
trace and records the ``profiling/simulate.py`` command of every run (``command``), and returns
its results for the plots (engine/sim/plots.py) and the document (engine/sim/report.py):

1. ``exp_policies``: average TTFT by placement policy (FAST'25 Fig. 5), the balancing threshold
   swept;
2. ``exp_rejection``: rejected requests under overload with no, early and predicted early
   rejection (arXiv-v3 Table 3), with prefill and decode load over time (arXiv-v3 Fig. 9-10);
3. ``exp_colocated``: requests meeting both SLOs, disaggregated vs colocated, at TBT
   100/200/300 ms (FAST'25 Fig. 1), and ``capacity`` read off them;
4. ``exp_hit_rate``: prefix cache hit rate against capacity and eviction policy (arXiv-v3
   Table 1);
5. ``exp_long_prompts``: TTFT of lone long prompts (16k to 128k tokens, the lengths of arXiv-v3's
   simulated data set) on a single prefill instance and on prefill groups of 2, 4 and 8 stages
   (chunked pipeline parallelism, arXiv-v3 §5.1; the papers give no figure for it).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from engine.cluster.conductor.cost_model import get_cost_model
from engine.sim.instances import SimCache
from engine.sim.simulate import long_prompt_trace
from engine.sim.simulator import SimConfig, Simulator
from engine.sim.trace import load_trace

INF = math.inf

PAPER_FIG5 = {"random": 19.65, "load": 5.27, "cache_aware": 3.58, "kvcentric": 3.07}
PAPER_ARXIV_FIG8 = {"random": 92.07, "load": 60.41, "cache_aware": 14.36, "kvcentric": 6.26}
PAPER_TABLE3 = {"none": 4183, "early": 3771, "predicted": 3589}
PAPER_FIG1 = {0.1: "+498%", 0.2: "+157%", 0.3: "+59%"}
PAPER_TABLE1 = {  # capacity in 512-token blocks -> LRU, LFU, LengthAware
    1000: (0.30, 0.30, 0.30),
    10000: (0.40, 0.35, 0.35),
    30000: (0.48, 0.43, 0.42),
    50000: (0.50, 0.49, 0.48),
    100000: (0.51, 0.51, 0.50),
    INF: (0.51, 0.51, 0.51),
}


def command(
    cfg: SimConfig, speed: float, duration: float, long_prompts: tuple[int, ...] = ()
) -> str:
    """The simulate.py command line of a run."""
    d = SimConfig()
    parts = [".venv/bin/python profiling/simulate.py"]
    if cfg.colocated:
        parts.append(f"--colocated {cfg.colocated}")
    else:
        parts.append(f"--prefill {cfg.prefill} --decode {cfg.decode}")
    if cfg.prefill_groups:
        parts.append(f"--prefill-groups {cfg.prefill_groups} --stages {cfg.stages}")
        if cfg.chunk_tokens != d.chunk_tokens:
            parts.append(f"--chunk-tokens {cfg.chunk_tokens}")
    if long_prompts:
        parts.append("--long-prompts " + ",".join(map(str, long_prompts)))
    parts.append(f"--policy {cfg.policy} --rejection {cfg.rejection} --speed {speed:g}")
    for flag, field in (
        ("--ttft-slo", "ttft_slo_s"),
        ("--tbt-slo", "tbt_slo_s"),
        ("--balancing-threshold", "balancing_threshold"),
        ("--cache-blocks", "cache_blocks"),
        ("--eviction", "eviction"),
    ):
        v = getattr(cfg, field)
        if v != getattr(d, field):
            parts.append(f"{flag} {v:g}" if isinstance(v, float) else f"{flag} {v}")
    if cfg.oracle_output:
        parts.append("--oracle-output")
    if duration:
        parts.append(f"--duration {duration:g}")
    parts.append(f"--seed {cfg.seed} --json")
    return " ".join(parts)


class Runner:
    def __init__(self, trace: Path, quick: bool) -> None:
        self.trace = trace
        self.quick = quick
        self.runs: list[dict] = []

    def run(
        self,
        cfg: SimConfig,
        speed: float = 1.0,
        duration: float = 0.0,
        long_prompts: tuple[int, ...] = (),
    ):
        if long_prompts:  # instead of the trace (simulate.py --long-prompts)
            bt = get_cost_model(cfg.cost_model).block_tokens
            reqs = long_prompt_trace(list(long_prompts), bt)
        else:
            if self.quick:
                duration = min(duration or 600.0, 600.0)
            reqs = load_trace(self.trace, speed, duration_s=duration)
        sim = Simulator(cfg, reqs)
        res = sim.run()
        res["command"] = command(cfg, speed, duration, long_prompts)
        self.runs.append({k: v for k, v in res.items() if k != "config"})
        print(f"  {res['wall_s']:6.1f}s  {res['command']}", file=sys.stderr, flush=True)
        return sim, res


# -- 1. policies --------------------------------------------------------------------------------


def exp_policies(r: Runner) -> dict:
    out = {"policies": {}, "thresholds": {}}
    for policy in ("random", "round_robin", "load", "cache_aware", "kvcentric"):
        cfg = SimConfig(policy=policy, rejection="none", ttft_slo_s=INF, tbt_slo_s=INF)
        _, res = r.run(cfg)
        out["policies"][policy] = res
    for thr in (1.0, 1.25, 2.0, 4.0, 16.0):
        cfg = SimConfig(rejection="none", ttft_slo_s=INF, tbt_slo_s=INF, balancing_threshold=thr)
        _, res = r.run(cfg)
        out["thresholds"][thr] = res
    out["thresholds"][1.5] = out["policies"]["kvcentric"]
    return out


# -- 2. rejection ---------------------------------------------------------------------------------

# (prefill, decode, speed): the paper's 8P+8D at 2x, then two set-ups whose decode overloads.
REJECT_SETUPS = ((8, 8, 2.0), (8, 1, 2.0), (8, 2, 4.0))
PLOTTED_SETUP = (8, 1, 2.0)  # its load over time is plotted


def setup_name(setup: tuple) -> str:
    return f"{setup[0]}P+{setup[1]}D at {setup[2]:g}x"


def exp_rejection(r: Runner) -> dict:
    out: dict = {}
    for setup in REJECT_SETUPS:
        prefill, decode, speed = setup
        out[setup] = {}
        for rej in ("none", "early", "predicted"):
            cfg = SimConfig(prefill=prefill, decode=decode, rejection=rej, timeline_s=10.0)
            sim, res = r.run(cfg, speed=speed)
            res["timeline"] = sim.timeline if setup == PLOTTED_SETUP else []
            out[setup][rej] = res
        if decode < prefill:  # the decode side overloads: predict with the outputs known
            cfg = SimConfig(
                prefill=prefill, decode=decode, rejection="predicted", oracle_output=True
            )
            out[setup]["oracle"] = r.run(cfg, speed=speed)[1]
    return out


# -- 3. disaggregated vs colocated ---------------------------------------------------------------

SPEEDS = (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
FIG1_DURATION = 1200.0  # the first 20 minutes of the trace keep the 14 runs short
SHARE = 0.9  # capacity: the highest replay speed at which this share of requests meets both SLOs


def exp_colocated(r: Runner) -> dict:
    out = {"disaggregated": {}, "colocated": {}}
    for speed in SPEEDS:
        for mode, cfg in (
            ("disaggregated", SimConfig(rejection="none", ttft_slo_s=INF, tbt_slo_s=INF)),
            ("colocated", SimConfig(colocated=16, rejection="none", ttft_slo_s=INF, tbt_slo_s=INF)),
        ):
            sim, res = r.run(cfg, speed=speed, duration=FIG1_DURATION)
            res["share"] = {tbt: sim.slo_share(30.0, tbt) for tbt in PAPER_FIG1}
            out[mode][speed] = res
    return out


def capacity(shares: dict[float, float]) -> float:
    """Highest speed with share >= SHARE, linearly interpolated between the measured speeds."""
    pts = sorted(shares.items())
    best = 0.0
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if v0 >= SHARE:
            best = s0
            if v1 < SHARE:
                return s0 + (s1 - s0) * (v0 - SHARE) / (v0 - v1)
    if pts and pts[-1][1] >= SHARE:
        best = pts[-1][0]
    return best


# -- 4. hit rate -------------------------------------------------------------------------------


def exp_hit_rate(r: Runner) -> dict:
    """One global cache (arXiv-v3 Table 1's set-up): prompt tokens found in it, weighted by the
    length of each block (the last block of a prompt may be partial)."""
    reqs = load_trace(r.trace, duration_s=600.0 if r.quick else 0.0)
    out: dict = {}
    for cap in PAPER_TABLE1:
        for policy in ("lru", "lfu", "length"):
            cache = SimCache(len(reqs) * 300 if cap == INF else int(cap), policy)
            hit = total = 0
            for q in reqs:
                keys = q.hash_ids
                n = cache.match(keys)
                cache.touch(keys[:n])
                hit += min(n * 512, q.input_len)
                total += q.input_len
                cache.insert(keys, set(keys))
            out[(cap, policy)] = hit / total
    return out


# -- 5. long prompts: chunked pipeline parallelism ----------------------------------------------

LONG_LENGTHS = (16384, 32768, 65536, 131072)  # arXiv-v3 Table 2's simulated data set
GROUP_STAGES = (1, 2, 4, 8)  # 1: a single prefill instance


def exp_long_prompts(r: Runner) -> dict:
    """TTFT of each length alone on the cluster, by stages: {stages: {length: seconds}}."""
    out: dict = {}
    for stages in GROUP_STAGES:
        if stages == 1:
            cfg = SimConfig(prefill=1, decode=1, rejection="none", ttft_slo_s=INF)
        else:
            cfg = SimConfig(prefill=0, prefill_groups=1, stages=stages, decode=1,
                            rejection="none", ttft_slo_s=INF)  # fmt: skip
        sim, res = r.run(cfg, long_prompts=LONG_LENGTHS)
        out[stages] = {n: sim.ttft[str(i)] for i, n in enumerate(LONG_LENGTHS)}
        out[stages]["command"] = res["command"]
    return out
