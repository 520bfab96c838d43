"""Instance times: what a prefill, a decode step and a KV copy cost, as stated constants.

Two uses: the Conductor's prior (its prefill-time and TBT models start from these before any
measurement arrives, the paper's "polynomial regression model fitted with offline data"), and the
cluster simulator's ground truth (``profiling/simulate.py --cost-model paper|smollm2-cpu``).

``paper``: LLaMA3-70B (FAST'25 used it; arXiv-v3 used LLaMA2-70B, whose KV per token is the same
under GQA-8) on one node of 8 x A800-SXM4-80GB with tensor parallelism. Every constant is a field
of ``CostModel`` with its source; those the papers do not state (MFU, bandwidth efficiency, step
overhead) are our assumptions and say so.

``smollm2-cpu``: SmolLM2-135M as a cluster worker runs it on this 2-core CPU (one thread, bf16),
fitted to times measured here by profiling/measure_cost.py (see ``SMOLLM2_CPU``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    name: str
    block_tokens: int  # tokens per KV block (the trace's hash_ids are 512-token blocks)
    # Prefill compute: FLOPs = layers * (attn_a * d * n * (n + p) + lin_b * d^2 * n) for n new
    # tokens after p cached ones (FAST'25 Eq. 2 at p = 0: l(a n^2 d + b n d^2)).
    layers: int
    hidden: int
    attn_a: float
    lin_b: float
    flops_per_s: float  # peak of the instance
    mfu: float  # fraction of peak prefill reaches
    prefill_overhead_s: float  # per prefill (scheduling, sampling the first token)
    # Cached prefix: loaded layer by layer while the rest computes, so prefill = max(load, compute).
    load_bytes_per_s: float
    kv_bytes_per_token: int
    # Decode step: read the weights and every running request's KV once per token.
    weight_bytes: float
    hbm_bytes_per_s: float
    hbm_efficiency: float
    decode_overhead_s: float  # per step (collectives, launches, sampling)
    decode_kv_capacity_tokens: int  # KV tokens a decode instance can hold (HBM after weights)
    max_batch: int  # running requests per decode instance
    # KV copy between instances (replication, prefill -> decode): bandwidth and a fixed latency.
    copy_bytes_per_s: float
    copy_latency_s: float
    # Share of a prefill's KV still in flight to the decode instance when the prefill ends
    # (layer-wise streaming sends layer i while layer i+1 computes: about one layer's worth).
    stream_tail_fraction: float
    # Per running request per decode step, beyond its KV read (attention, sampling and
    # bookkeeping: on a CPU these grow with the batch; on the paper's GPUs they are in the
    # overhead).
    decode_per_request_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "block_tokens", "kv_bytes_per_token", "max_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("flops_per_s", "load_bytes_per_s", "hbm_bytes_per_s", "copy_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")
        for f in ("mfu", "hbm_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"{f} must be in (0, 1], got {getattr(self, f)}")
        if self.decode_per_request_s < 0:
            raise ValueError(f"decode_per_request_s must be >= 0, got {self.decode_per_request_s}")
        if not 0 <= self.stream_tail_fraction <= 1:
            raise ValueError(
                f"stream_tail_fraction must be in [0, 1], got {self.stream_tail_fraction}"
            )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` already held (locally)."""
        n, p, d = new_tokens, cached_tokens, self.hidden
        flops = self.layers * (self.attn_a * d * n * (n + p) + self.lin_b * d * d * n)
        compute = flops / (self.flops_per_s * self.mfu)
        load = p * self.kv_bytes_per_token / self.load_bytes_per_s
        return self.prefill_overhead_s + max(compute, load)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        read = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        flops = self.layers * self.lin_b * self.hidden**2 * batch  # the linear layers, per token
        return (
            self.decode_overhead_s
            + self.decode_per_request_s * batch
            + max(
                read / (self.hbm_bytes_per_s * self.hbm_efficiency),
                flops / (self.flops_per_s * self.mfu),
            )
        )

    def copy_s(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens of KV from one instance to another."""
        if tokens <= 0:
            return 0.0
        return self.copy_latency_s + tokens * self.kv_bytes_per_token / self.copy_bytes_per_s

    def hidden_copy_s(self, tokens: int) -> float:
        """Seconds to pass ``tokens`` tokens' hidden states (16-bit) from one pipeline stage to
        the next (chunked pipeline parallelism, pipeline.py), over the same links as KV."""
        if tokens <= 0:
            return 0.0
        return self.copy_latency_s + tokens * self.hidden * 2 / self.copy_bytes_per_s

    def stream_tail_s(self, prompt_tokens: int) -> float:
        """What layer-wise streaming leaves after the prefill ends (added to TTFT)."""
        return self.stream_tail_fraction * self.copy_s(prompt_tokens)


# LLaMA3-70B: 80 layers, hidden 8192, 8 KV heads of 128 -> KV 2 * 80 * 8 * 128 * 2 B = 320 KiB
# per token (FAST'25: "320 KB/token"); 70.6e9 bf16 parameters = 141 GB of weights.
# 8 x A800-SXM4-80GB: 312 TFLOP/s bf16 dense and 2.039 TB/s HBM each (NVIDIA spec sheet);
# H2D 128 GB/s and the 4 x 200 Gbps NICs with 87 GB/s measured by the Transfer Engine (FAST'25).
PAPER = CostModel(
    name="paper",
    block_tokens=512,
    layers=80,
    hidden=8192,
    attn_a=4.0,  # FAST'25 Table 1
    lin_b=22.0,  # FAST'25 Table 1
    flops_per_s=8 * 312e12,
    mfu=0.5,  # assumption: prefill MFU of a tuned TP-8 node
    prefill_overhead_s=0.02,  # assumption
    load_bytes_per_s=128e9,  # FAST'25 Table 1, B_h2d
    kv_bytes_per_token=2 * 80 * 8 * 128 * 2,
    weight_bytes=70.6e9 * 2,
    hbm_bytes_per_s=8 * 2.039e12,
    hbm_efficiency=0.6,  # assumption
    decode_overhead_s=0.005,  # assumption: 160 all-reduces and launches per step
    # (8 * 80 GB - 141 GB of weights) * 0.87 (activations, fragmentation) / 320 KiB
    decode_kv_capacity_tokens=1_330_000,
    max_batch=256,  # assumption (vLLM's default max_num_seqs)
    copy_bytes_per_s=87e9,  # FAST'25 Fig. 12, 4 x 200 Gbps RoCE
    copy_latency_s=0.001,  # assumption
    stream_tail_fraction=1 / 80,  # one layer of 80 left in flight
)

# SmolLM2-135M as a cluster worker runs it on this machine: one torch thread, bfloat16 (the
# workers' dtype auto on this AVX512-BF16 CPU). 30 layers, hidden 576, 3 KV heads of 64: KV
# 2 * 30 * 3 * 64 * 2 B = 23,040 B per token; 134.5M parameters = 269 MB of weights.
# Fitted by ``python profiling/measure_cost.py`` (--threads 1 --dtype auto; 2026-11-30, 99 s,
# load average 7 on the 2 cores shared with other jobs, so these are times under contention, as
# the cluster benchmarks see them): prefill = 32 ms + FLOPs / 52.8 GFLOP/s (measured 0.36 s for
# 64 tokens, 2.6 s for 512, 6.7 s for 1,024; 1.9 s for 256 after 512 cached); decode step =
# 1 ms + 269 MB / 2.16 GB/s + 19 ms per running request (measured 141 / 207 / 428 ms at batch
# 1 / 4 / 16). ``mfu`` and ``hbm_efficiency`` are 1: the rates are the effective ones measured.
SMOLLM2_CPU = CostModel(
    name="smollm2-cpu",
    block_tokens=512,
    layers=30,
    hidden=576,
    attn_a=4.0,
    lin_b=2 * 134.5e6 / (30 * 576 * 576),  # 2 FLOPs per parameter per token, as l * b * d^2
    flops_per_s=5.281e10,
    mfu=1.0,
    prefill_overhead_s=0.03232,
    load_bytes_per_s=5e9,  # assumption: a DRAM copy
    kv_bytes_per_token=2 * 30 * 3 * 64 * 2,
    weight_bytes=134.5e6 * 2,
    hbm_bytes_per_s=2.157e9,
    hbm_efficiency=1.0,
    decode_overhead_s=0.001,  # assumption (inside the fitted batch-independent part)
    decode_kv_capacity_tokens=200_000,  # assumption: about 4.6 GB of KV
    max_batch=64,
    # Block copies between workers over TCP on this host (block_copy.py: gather, send, receive,
    # check, scatter): an assumption, not measured.
    copy_bytes_per_s=1e9,
    copy_latency_s=0.002,
    stream_tail_fraction=1 / 30,
    decode_per_request_s=0.01896,
)

COST_MODELS = {"paper": PAPER, "smollm2-cpu": SMOLLM2_CPU}


def get_cost_model(name: str) -> CostModel:
    if name not in COST_MODELS:
        raise ValueError(f"cost model {name!r} is unknown; choose one of {', '.join(COST_MODELS)}")
    return COST_MODELS[name]
