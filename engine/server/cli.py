"""The command line: ``engine generate``, ``engine chat``, ``engine serve``, ``engine rpc``,
``engine worker``, ``engine router``, ``engine cluster``."""

from __future__ import annotations

import argparse
import sys
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


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace):
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


def _params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _llm(args: argparse.Namespace):
    from engine.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _params(args)
    prompts = args.prompt or ["Hello! Who are you?"]
    if args.raw:
        outs = llm.generate(prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        print(f">>> {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        reply = []
        try:
            for delta in llm.stream(llm.apply_chat_template(messages), params):
                reply.append(delta)
                print(delta, end="", flush=True)
        except ValueError as exc:  # e.g. the conversation outgrew the context
            print(f"\n[error: {exc}]")
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate for one or more prompts and print the answers")
    add_engine_options(g)
    _sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    add_engine_options(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="a system prompt")
    c.set_defaults(func=cmd_chat)

    try:
        from engine.server.commands import add_server_commands
    except ImportError:
        pass
    else:
        add_server_commands(sub, add_engine_options)
        from engine.server.cluster_commands import add_cluster_commands

        add_cluster_commands(sub, add_engine_options)

    from engine.kvcache.pool_cli import add_pool_commands

    add_pool_commands(sub)

    from engine.security.keys_cli import add_curve_option, add_keys_commands, apply_curve_option

    for command in list(sub.choices.values()):
        add_curve_option(command)
    add_keys_commands(sub)

    args = parser.parse_args(argv)
    try:
        apply_curve_option(args)
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
