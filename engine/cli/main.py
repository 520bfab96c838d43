"""The command line: ``engine generate``, ``engine chat``, ``engine serve``, ``engine rpc``,
``engine worker``, ``engine router``, ``engine cluster``."""

# The docstring above is ``engine --help``'s description. Where the commands are: generate and chat
# here; serve and rpc in server/commands.py; worker, router and cluster in
# server/cluster_commands.py; pool in kvcache/pool_cli.py; keys in security/keys_cli.py. The
# engine's options (and generate's and chat's sampling options) are in server/engine_options.py.

from __future__ import annotations

import argparse
import sys

from engine.cli.cluster import add_cluster_commands
from engine.cli.engine_options import (
    add_engine_options,
    add_sampling_options,
    engine_config_from_args,
    sampling_params_from_args,
)
from engine.cli.keys import add_curve_option, add_keys_commands, apply_curve_option
from engine.cli.pool import add_pool_commands
from engine.cli.serve import add_server_commands


def _llm(args: argparse.Namespace):
    from engine.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = sampling_params_from_args(args)
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
    params = sampling_params_from_args(args)
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
    add_sampling_options(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    add_engine_options(c)
    add_sampling_options(c)
    c.add_argument("--system", default=None, help="a system prompt")
    c.set_defaults(func=cmd_chat)

    add_server_commands(sub, add_engine_options)
    add_cluster_commands(sub, add_engine_options)
    add_pool_commands(sub)
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
