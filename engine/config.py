"""Typed, frozen configuration for the model, the KV cache, the scheduler and the engine.

Every config validates itself in ``__post_init__`` and raises ``ValueError`` naming the field
and the limit, so a bad setting fails where it is made, not deep inside a forward pass.

A leaf: plain values only, no torch, and nothing of ``engine/`` but the plain-value modules
``pipeline_stage.py``, ``pool_spec.py`` and ``speculative_config.py`` (tests/test_config.py checks
it; SpeculativeConfig is re-exported here). What the values resolve to on this machine
(``device="auto"``, ``dtype="auto"``): engine/core/device_resolution.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.pipeline_stage import WHOLE_MODEL, PipelineStage
from engine.pool_spec import PoolSpec, parse_pool_spec
from engine.speculative_config import SpeculativeConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


QUANTIZATIONS = ("int8", "w8a8")

# How the scheduler orders its waiting requests and picks whom to preempt (vLLM's
# --scheduling-policy): arrival order, or (priority, arrival), a lower priority value first.
SCHEDULING_POLICIES = ("fcfs", "priority")


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")
KV_CACHE_DTYPE_ALIASES = {
    "fp8": "int8",  # vLLM's name for a 1-byte cache
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
}


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name of a ``kv_cache_dtype``; ValueError naming the field and the choices."""
    canon = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if canon not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (fp8 means int8), "
            f"got {name!r}"
        )
    return canon


def parse_rope_scaling(text: str) -> RopeScaling:
    """``--rope-scaling``'s JSON object (a Hugging Face ``rope_scaling``); ValueError naming the
    field. ``original_max_position_embeddings`` is required here: the override does not know the
    model's length."""
    import json

    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"rope_scaling: not a JSON object ({e.msg})") from None
    if not isinstance(params, dict):
        raise ValueError("rope_scaling: not a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and "original_max_position_embeddings" not in params:
        raise ValueError("rope_scaling: give original_max_position_embeddings (the model's length)")
    return RopeScaling.from_dict(params, 1, "rope_scaling")


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


ROPE_KINDS = ("default", "linear", "llama3", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling, as Hugging Face configs name it (``rope_type``): "default", "linear"
    (positions divided by ``factor``), "llama3" (Llama 3.1: low frequencies divided, high ones
    kept, blended between), "dynamic" (NTK-aware: the base raised so that
    ``original_max_position_embeddings * factor`` positions fit; fixed at that length, as vLLM
    does, since a base that followed each sequence's length would make its cached keys stale)
    and "yarn" (YaRN: frequencies interpolated by wavelength between ``beta_fast`` and
    ``beta_slow`` rotations, and cos/sin scaled by ``attention_factor``, by default
    0.1 ln(factor) + 1). engine/layers/rotary.py computes them."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn; None: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(
                f"rope_scaling.kind must be one of {', '.join(ROPE_KINDS)}, got {self.kind!r}"
            )
        _positive("rope_scaling.factor", self.factor)
        _positive(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )

    @property
    def context(self) -> int | None:
        """The positions a scaling that stretches the context covers (original x factor), or
        None for default and llama3 (whose models state their own length)."""
        if self.kind in ("linear", "dynamic", "yarn"):
            return int(self.original_max_position_embeddings * self.factor)
        return None

    @classmethod
    def from_dict(cls, params: dict[str, Any], model_max: int, where: str) -> RopeScaling:
        """From a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` or
        ``type``), ``original_max_position_embeddings`` defaulting to ``model_max`` for yarn and
        dynamic; ValueError
        naming ``where`` and the field for a kind or value it cannot take."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_KINDS:
            raise ValueError(
                f"{where}: rope scaling {kind!r} is not supported ({', '.join(ROPE_KINDS)})"
            )
        if kind == "default":
            return cls()
        if "factor" not in params:
            raise ValueError(f"{where}: rope scaling {kind!r} needs a factor")
        known = {
            "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
            "truncate", "rope_theta", "mscale", "mscale_all_dim", "partial_rotary_factor",
        }  # fmt: skip
        odd = sorted(set(params) - known)
        if odd:
            raise ValueError(f"{where}: unknown rope scaling field {odd[0]!r}")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{where}: partial rotary (partial_rotary_factor) is not supported")
        attn = params.get("attention_factor")
        return cls(
            kind=kind,
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            # yarn and dynamic default to the model's length, as Hugging Face does
            original_max_position_embeddings=int(
                params.get(
                    "original_max_position_embeddings",
                    model_max if kind in ("yarn", "dynamic") else 8192,
                )
            ),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            attention_factor=None if attn is None else float(attn),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs to know about a Llama-family model.

    ``architecture`` is one of SUPPORTED_ARCHITECTURES ("llama" also covers SmolLM). Weights are
    handed to the runtime under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``
    ...), whatever the file format was.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before rotary
    sliding_window: int | None = None  # recorded; full attention is used (see README)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


# The CPU default KV cache (kv_cache_memory_gb=None): room for this many requests of the full
# context at once, and never more than this share of the memory available when the engine
# starts. A CPU serves few sequences fast; a bigger cache is slower to start (it is zeroed)
# and holds memory nobody asked for. Set kv_cache_memory_gb (--kv-cache-memory-gb) for more.
CPU_KV_DEFAULT_SEQS = 4
CPU_KV_MAX_SHARE_OF_AVAILABLE = 0.2


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens for every layer.

    ``num_blocks=None`` sizes the cache from ``kv_cache_memory_gb`` on every device when it is
    given. Otherwise, on CUDA: ``gpu_memory_utilization`` is this process's share of the GPU's
    total memory (weights, activations and KV cache together, as vLLM's flag; two engines on one
    GPU can take 0.45 each), and the KV cache gets that share minus what the process holds after
    loading the weights and an estimate of a step's activations (engine/kvcache/kv_budget.py).
    On CPU: ``sized_for`` picks enough for CPU_KV_DEFAULT_SEQS requests of the full context,
    capped at CPU_KV_MAX_SHARE_OF_AVAILABLE of available memory.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None:
            _positive("kv_cache_memory_gb", self.kv_cache_memory_gb)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def sized_for(
        self, bytes_per_token: int, max_model_len: int, max_num_seqs: int
    ) -> tuple[CacheConfig, str]:
        """This config with the CPU default size filled in (unchanged if a size was given),
        and a line saying what was chosen and why, for the log."""
        if self.num_blocks is not None or self.kv_cache_memory_gb is not None:
            return self, ""
        import psutil

        seqs = min(max_num_seqs, CPU_KV_DEFAULT_SEQS)
        wanted = max_model_len * seqs * bytes_per_token
        cap = int(psutil.virtual_memory().available * CPU_KV_MAX_SHARE_OF_AVAILABLE)
        size = max(min(wanted, cap), 2 * self.block_size * bytes_per_token)
        why = (
            f"{seqs} sequences of {max_model_len} tokens"
            if size == wanted
            else f"capped at {CPU_KV_MAX_SHARE_OF_AVAILABLE:.0%} of available memory"
        )
        gb = size / 1024**3
        line = (
            f"KV cache: {gb:.2f} GiB, {size // bytes_per_token} tokens ({why}); "
            "set --kv-cache-memory-gb (kv_cache_memory_gb) to change it"
        )
        from dataclasses import replace

        return replace(self, kv_cache_memory_gb=gb), line


# max_num_batched_tokens when it is not set, per device type. A step's prefill chunks end together,
# so every prompt that finishes in a step waits for the whole step: on a 2-core CPU a step of 2048
# prompt tokens takes seconds. Measured with profiling/bench_peer.py's chat load (16 at a time,
# 60-400 words): on an AVX2-only AMD EPYC (Zen 3) 1024 kept the output rate of 2048 (52.6 against
# 52.8 tok/s) at 0.69x its TTFT p50 (7.1 against 10.3 s), 512 lost 11% of the rate; capped to
# AVX2 on a Zen 4 EPYC likewise (1.43-1.54x llama-server's rate at either, TTFT 4.0-4.5 against
# 6.0-7.6 s). On CUDA a step of 2048 tokens is milliseconds and fills the GPU better.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 1024, "cuda": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: tokens per step and sequences per step.
    ``max_num_batched_tokens=None``: the device's default (DEFAULT_MAX_NUM_BATCHED_TOKENS), filled
    in by ``for_device`` when the engine knows its device; the Scheduler takes a number."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    max_waiting: int = 4096  # admission queue bound; add_request beyond it raises QueueFullError
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole remaining budget
    # "fcfs": arrival order, the newest running request preempted first; requests must carry
    # priority 0. "priority": waiting requests by (priority, arrival), lower values first, and
    # the running request of the largest (priority, arrival) preempted first
    # (engine/core/scheduler.py). vLLM's SchedulerConfig.policy.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy (--scheduling-policy) must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_waiting", self.max_waiting)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with ``max_num_batched_tokens`` set: its own, else the default of
        ``device_type`` ("cpu", "cuda")."""
        if self.max_num_batched_tokens is not None:
            return self
        from dataclasses import replace

        default = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type)
        if default is None:
            raise ValueError(
                f"max_num_batched_tokens: no default for device type {device_type!r} "
                f"(defaults: {DEFAULT_MAX_NUM_BATCHED_TOKENS}); set it"
            )
        return replace(self, max_num_batched_tokens=default)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs. ``model``: "default" or a GGUF file or HF dir."""

    model: str = "default"
    # auto: bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX (engine/cpu_isa.py auto_dtype,
    # under its ENGINE_CPU_ISA cap), float32 on other CPUs (bf16 there too with int8 weights:
    # measured faster for int8 decode). Norm
    # statistics, rotary, softmax, logits and sampling stay in float32 whatever the dtype.
    dtype: str = "auto"
    # The dtype the float weights (projections, embedding / LM head) are held in: "auto" is
    # dtype's own, except under dtype=auto on CPUs without native bf16 whose C row dots widen
    # bf16 in registers (AVX2, AVX-512): bfloat16 weights, float32 activations (cpu_isa
    # auto_weight_dtype). A 16-bit weight_dtype other than dtype takes dtype float32.
    weight_dtype: str = "auto"
    # The KV cache's element type (vLLM's --kv-cache-dtype): auto is the activations' dtype
    # (bfloat16 where dtype=auto picks float32 with bf16 weights: cpu_isa auto_kv_dtype);
    # bfloat16, float16, float32 whatever the activations; int8 a row of int8 values per token
    # and KV head with its float16 scale (engine/kvcache/kv_dtype.py; "fp8" means int8; CPU only).
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    # "int8": weight-only int8 (per-output-channel scales) for the linear layers and the
    # embedding / LM head; activations, norms, KV cache and the scales stay in ``dtype`` (any).
    quantization: str | None = None
    # torch.compile the decoder layers' dense parts (dynamic shapes: a new batch size does not
    # recompile). Off by default: measured on the 2-core AVX512-BF16 machine it does not pay
    # (profiling/bench_step.py --compile): the GEMMs and the eager attention dominate a step and
    # dynamo's guard checks (~0.5 ms per compiled call under load) eat what fusion saves.
    compile: bool = False
    # Deterministic (batch-invariant) on the CPU: every step, prefill chunks and decodes alike,
    # runs through the C layers (kernels/native: the fixed-order GEMM of gemm.h, attention in
    # chunks at absolute positions), and the LM head through the same GEMM, so a request's
    # logits depend only on its own tokens, never on the batch it lands in, the chunk budget,
    # prefill or decode, or the thread count (docs/determinism.md). Where the C layers do not
    # apply (no C compiler, int8 weights, CUDA, torch.compile) it has no effect. False: prefill
    # chunks and big batches take torch's GEMMs and attention (see the doc for the cost of each).
    deterministic: bool = True
    # bf16 on the CPU: keep the projections' and the LM head's weights also in oneDNN's blocked
    # layout (bit-identical products without a reorder per call; layers/linear.py pack_bf16).
    # Costs a second copy of those weights in memory; False keeps one. Only where oneDNN packs
    # bf16 (cpu_isa.CpuIsa.onednn_packs: AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere the
    # plain weights serve whatever this says.
    pack_weights: bool = True
    # None: the model's context (max_position_embeddings, or what rope_scaling stretches it to).
    # Beyond it the engine serves with a warning: positions the model never saw (docs/serving.md).
    max_model_len: int | None = None
    # Override the model's rotary scaling: a JSON object as Hugging Face configs write it, e.g.
    # '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}' (kinds:
    # RopeScaling). Parsed into ``rope_override``.
    rope_scaling: str | None = None
    # Keep a GGUF model's dequantized weights in a file (engine/model/weight_cache.py) and map it on
    # later starts; ENGINE_WEIGHT_CACHE=0 turns it off too.
    weight_cache: bool = True
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    show_progress: bool = False
    # Tiered KV pool, e.g. "dram=4GiB,ssd=/var/cache/kv:50GiB" or "dram=1GiB,tcp://HOST:PORT"
    # (engine/pool_spec.py); None: KV lives only in the paged cache.
    kv_pool: str | None = None
    # CUDA: run decode-only steps eagerly instead of through the CUDA graphs captured per batch
    # size at start-up (engine/core/cuda_graphs.py). No effect on CPU, which never uses graphs.
    enforce_eager: bool = False
    # One stage of a chunked prefill pipeline (engine/pipeline_stage.py): the engine holds only
    # the stage's layers and their KV, and runs with a StageIO (engine/core/stage_io.py).
    stage: PipelineStage = WHOLE_MODEL
    # kv_pool parsed, by __post_init__ (None without a pool): what the engine builds the pool from.
    pool_spec: PoolSpec | None = field(default=None, init=False, repr=False, compare=False)
    # rope_scaling parsed, by __post_init__ (None: the model's own)
    rope_override: RopeScaling | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.stage, PipelineStage):
            raise ValueError(f"stage must be a PipelineStage, got {self.stage!r}")
        if self.kv_pool is not None and not self.stage.is_whole:
            raise ValueError(
                f"pipeline stages run without a KV pool (stage {self.stage}, "
                f"kv_pool {self.kv_pool!r})"
            )
        if self.kv_pool is not None:  # ValueError naming the bad part
            object.__setattr__(self, "pool_spec", parse_pool_spec(self.kv_pool))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_override", parse_rope_scaling(self.rope_scaling))
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16, got {self.dtype!r}"
            )
        if self.weight_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                "weight_dtype must be one of auto, float32, float16, bfloat16, "
                f"got {self.weight_dtype!r}"
            )
        if self.weight_dtype != "auto" and self.quantization is not None:
            raise ValueError(
                f"weight_dtype {self.weight_dtype} with quantization {self.quantization}: the "
                "quantized weights are int8; leave weight_dtype auto"
            )
        if self.weight_dtype != "auto" and self.dtype not in ("auto", "float32", self.weight_dtype):
            raise ValueError(
                f"weight_dtype {self.weight_dtype} with dtype {self.dtype}: weights other than "
                "the dtype's own are 16-bit ones under dtype float32"
            )
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )

    def resolved_compile(self) -> bool:
        return self.compile

    def with_overrides(self, **kwargs: Any) -> EngineConfig:
        from dataclasses import replace

        return replace(self, **kwargs)
