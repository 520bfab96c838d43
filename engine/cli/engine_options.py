"""The engine's options on the command line (``--model``, ``--dtype``, ..., ``--kv-pool``) and the
EngineConfig they make, for every command that builds an engine (``generate``, ``chat``, ``serve``,
``rpc``, ``worker``, ``cluster``) and for the commands that pass them on to another process; and
the sampling options of ``generate`` and ``chat``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help='"default" (SmolLM2-135M), a GGUF or HF dir')
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantization", default=None, choices=["int8"], help="weight-only int8 (16-bit dtypes)"
    )
    p.add_argument(
        "--compile",
        default=False,
        action=argparse.BooleanOptionalAction,
        help="torch.compile the layers' dense parts (default off: see EngineConfig.compile)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--weight-cache",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="map a GGUF model's dequantized weights from ~/.cache/engine/weights (or "
        "$ENGINE_WEIGHT_CACHE_DIR), writing them there on the first start (default on; "
        "ENGINE_WEIGHT_CACHE=0 also turns it off)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size on CPU (default: 4 requests of the full context, at most 20%% "
        "of available memory; the log says what was chosen)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kv-pool",
        default=None,
        metavar="SPEC",
        help='tiered KV pool, e.g. "dram=4GiB,ssd=/var/cache/kv:50GiB" or "dram=1GiB,tcp://H:P"',
    )


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


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of this command line that were set, for another process's (the
    workers of ``engine cluster``, a server a benchmark starts)."""
    return set_options(args, add_engine_options)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """The sampling options of ``engine generate`` and ``engine chat``."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig that ``add_engine_options`` describe, as ``args`` has them."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        compile=args.compile,
        max_model_len=args.max_model_len,
        weight_cache=args.weight_cache,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
        show_progress=True,
        kv_pool=args.kv_pool,
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
