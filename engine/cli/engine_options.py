"""The engine's options on the command line (``--model``, ``--dtype``, ..., ``--kv-pool``) and the
EngineConfig they make, for every command that builds an engine (``generate``, ``chat``, ``serve``,
``rpc``, ``worker``, ``cluster``) and for the commands that pass them on to another process; and
the sampling options of ``generate`` and ``chat``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field


@dataclass(frozen=True)
class EngineFlag:
    """One engine option: its flag, the EngineConfig field it sets (``cache.`` and
    ``scheduler.`` name the nested configs' fields) and argparse's keywords. ``default`` must be
    the field's default (a test checks it; the flags are declared without importing the config,
    which imports torch, so that ``engine --help`` stays fast)."""

    flag: str
    field: str
    default: object = None
    kwargs: dict = dataclass_field(default_factory=dict)
    invert: bool = False  # a store_true flag that sets the field to False (--no-prefix-caching)


_BOOL = argparse.BooleanOptionalAction
ENGINE_FLAGS = (
    EngineFlag(
        "--model", "model", "default", {"help": '"default" (SmolLM2-135M), a GGUF or HF dir'}
    ),
    EngineFlag("--dtype", "dtype", "auto", {"choices": ["auto", "float32", "float16", "bfloat16"]}),
    EngineFlag(
        "--weight-dtype",
        "weight_dtype",
        "auto",
        {
            "choices": ["auto", "float32", "float16", "bfloat16"],
            "help": "dtype of the float weights: auto is --dtype's own, except bfloat16 weights "
            "under float32 activations where --dtype auto picks float32 on a CPU whose C row "
            "dots widen bf16 (AVX2, AVX-512 without BF16); a 16-bit one with --dtype float32",
        },
    ),
    EngineFlag(
        "--kv-cache-dtype",
        "kv_cache_dtype",
        "auto",
        {
            "choices": ["auto", "bfloat16", "float16", "float32", "int8", "fp8"],
            "help": "the KV cache's element type: auto is the activations', or bfloat16 where "
            "--dtype auto picks float32 on a CPU; int8 keeps each token's row of each KV head "
            "as int8 with its scale (fp8 means int8; CPU only)",
        },
    ),
    EngineFlag("--device", "device", "auto"),
    EngineFlag(
        "--quantization",
        "quantization",
        None,
        {
            "choices": ["int8", "w8a8"],
            "help": "int8: weight-only int8 (16-bit dtypes); w8a8: int8 weights and activations "
            "with a scale per block of 32, integer products (CPU only; docs/cpu.md)",
        },
    ),
    EngineFlag(
        "--compile",
        "compile",
        False,
        {
            "action": _BOOL,
            "help": "torch.compile the layers' dense parts (default off: see EngineConfig.compile)",
        },
    ),
    EngineFlag(
        "--deterministic",
        "deterministic",
        True,
        {
            "action": _BOOL,
            "help": "CPU: a request's tokens and logprobs do not depend on the batch it lands in "
            "(default on; --no-deterministic: torch's GEMMs for prefill, see docs/determinism.md)",
        },
    ),
    EngineFlag(
        "--enforce-eager",
        "enforce_eager",
        False,
        {
            "action": "store_true",
            "help": "CUDA: run decode steps eagerly, without the CUDA graphs captured at start-up "
            "(no effect on CPU, which never uses graphs)",
        },
    ),
    EngineFlag(
        "--max-model-len",
        "max_model_len",
        None,
        {
            "type": int,
            "help": "the longest prompt + output served (default: the model's context; past it "
            "with a warning)",
        },
    ),
    EngineFlag(
        "--rope-scaling",
        "rope_scaling",
        None,
        {
            "metavar": "JSON",
            "help": "override the model's rotary scaling, e.g. "
            '\'{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}\' '
            "(kinds: linear, dynamic, yarn, llama3)",
        },
    ),
    EngineFlag(
        "--weight-cache",
        "weight_cache",
        True,
        {
            "action": _BOOL,
            "help": "map a GGUF model's dequantized weights from ~/.cache/engine/weights (or "
            "$ENGINE_WEIGHT_CACHE_DIR), writing them there on the first start (default on; "
            "ENGINE_WEIGHT_CACHE=0 also turns it off)",
        },
    ),
    EngineFlag("--block-size", "cache.block_size", 16, {"type": int}),
    EngineFlag(
        "--kv-cache-memory-gb",
        "cache.kv_cache_memory_gb",
        None,
        {
            "type": float,
            "help": "KV cache size, on every device (default on CPU: 4 requests of the full "
            "context, at most 20%% of available memory; on CUDA: from --gpu-memory-utilization; "
            "the log says what was chosen)",
        },
    ),
    EngineFlag(
        "--gpu-memory-utilization",
        "cache.gpu_memory_utilization",
        0.85,
        {
            "type": float,
            "help": "this process's share of the GPU's total memory, weights + activations + KV "
            "cache (as vLLM's; two engines on one GPU: 0.45 each). engine cluster: the share of "
            "each GPU for all its workers there, split evenly (docs/cluster.md)",
        },
    ),
    EngineFlag(
        "--max-num-batched-tokens",
        "scheduler.max_num_batched_tokens",
        None,
        {
            "type": int,
            "help": "tokens per step, prompt chunks and decodes together (default: 1024 on the "
            "CPU, 2048 on CUDA; config.py DEFAULT_MAX_NUM_BATCHED_TOKENS)",
        },
    ),
    EngineFlag("--max-num-seqs", "scheduler.max_num_seqs", 128, {"type": int}),
    EngineFlag(
        "--scheduling-policy",
        "scheduler.policy",
        "fcfs",
        {
            "choices": ["fcfs", "priority"],
            "help": "fcfs: requests in arrival order, and a request's priority must be 0; "
            "priority: by the requests' priority field (lower first), then arrival, and the "
            "lowest priority preempted first when KV blocks run out (as vLLM's)",
        },
    ),
    EngineFlag(
        "--no-prefix-caching", "cache.enable_prefix_caching", True, {"action": "store_true"}, True
    ),
    EngineFlag(
        "--speculative",
        "speculative.method",
        None,
        {
            "choices": ["ngram", "suffix"],
            "help": "draftless speculative decoding: ngram (prompt lookup in the request's "
            "tokens) or suffix (the request's tokens and recent outputs); default off "
            "(docs/speculative.md)",
        },
    ),
    EngineFlag(
        "--num-speculative-tokens",
        "speculative.num_speculative_tokens",
        5,
        {"type": int, "help": "the most tokens proposed per sequence and step"},
    ),
    EngineFlag(
        "--prompt-lookup-min",
        "speculative.prompt_lookup_min",
        2,
        {"type": int, "help": "ngram: the shortest n-gram matched"},
    ),
    EngineFlag(
        "--prompt-lookup-max",
        "speculative.prompt_lookup_max",
        4,
        {"type": int, "help": "ngram: the longest n-gram matched (tried first)"},
    ),
    EngineFlag(
        "--suffix-cache-requests",
        "speculative.suffix_cache_requests",
        256,
        {"type": int, "help": "suffix: how many recent requests' outputs are kept to match"},
    ),
    EngineFlag(
        "--speculative-adaptive",
        "speculative.adaptive",
        True,
        {
            "action": _BOOL,
            "help": "each sequence proposes fewer tokens as its proposals are rejected, down to "
            "none (default on)",
        },
    ),
    EngineFlag(
        "--kv-pool",
        "kv_pool",
        None,
        {
            "metavar": "SPEC",
            "help": 'tiered KV pool, e.g. "dram=4GiB,ssd=/var/cache/kv:50GiB" or '
            '"dram=1GiB,tcp://H:P"',
        },
    ),
)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    for f in ENGINE_FLAGS:
        default = (not f.default) if f.invert else f.default
        p.add_argument(f.flag, default=default, **f.kwargs)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def set_options(
    args: argparse.Namespace, add_options: Callable[[argparse.ArgumentParser], None], skip=()
) -> list[str]:
    """The command line that gives another process the options that ``add_options`` defines, as
    ``args`` has them: only those whose value differs from the default (so a default is never
    written out, and the other process applies its own), each in the form its action takes."""
    p = argparse.ArgumentParser(add_help=False)
    add_options(p)
    out: list[str] = []
    for action in p._actions:
        if action.dest in skip or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                out += [flag, str(v)]
        elif isinstance(action, argparse._StoreAction) and action.nargs is None:
            out += [flag, str(value)]
        else:  # a new kind of option: say so rather than drop it
            raise TypeError(f"cannot pass {flag} ({type(action).__name__}) on to the workers")
    return out


def engine_argv(args: argparse.Namespace, skip=()) -> list[str]:
    """The engine options of this command line that were set, for another process's (the
    workers of ``engine cluster``, a server a benchmark starts), but those whose dest is in
    ``skip``."""
    return set_options(args, add_engine_options, skip=skip)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """The sampling options of ``engine generate`` and ``engine chat``."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig that ``ENGINE_FLAGS`` describe, as ``args`` has them."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

    fields: dict[str, dict] = {"": {}, "cache": {}, "scheduler": {}, "speculative": {}}
    for f in ENGINE_FLAGS:
        value = getattr(args, _dest(f.flag))
        group, _, name = f.field.rpartition(".")
        fields[group][name] = (not value) if f.invert else value
    return EngineConfig(
        **fields[""],
        cache=CacheConfig(**fields["cache"]),
        scheduler=SchedulerConfig(**fields["scheduler"]),
        speculative=SpeculativeConfig(**fields["speculative"]),
        show_progress=True,
    )


def sampling_params_from_args(args: argparse.Namespace):
    """The SamplingParams that ``add_sampling_options`` describe, as ``args`` has them."""
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
