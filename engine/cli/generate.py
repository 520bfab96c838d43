"""``engine generate`` (prompts in, answers printed) and ``engine chat`` (an interactive chat that
streams tokens): the embedded engine from the command line."""

from __future__ import annotations

import argparse
import sys

from engine.cli.engine_options import (
    add_engine_options,
    add_sampling_options,
    engine_config_from_args,
    sampling_params_from_args,
)


def add_generate_commands(sub) -> None:
    g = sub.add_parser("generate", help="generate for one or more prompts and print the answers")
    add_engine_options(g)
    add_sampling_options(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument(
        "--priority",
        type=int,
        action="append",
        help="each prompt's priority, in --prompt's order (with --scheduling-policy priority: "
        "lower first, when more prompts than --max-num-seqs wait)",
    )
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    add_engine_options(c)
    add_sampling_options(c)
    c.add_argument("--system", default=None, help="a system prompt")
    c.set_defaults(func=cmd_chat)


def _llm(args: argparse.Namespace):
    from engine.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or ["Hello! Who are you?"]
    if args.priority is not None:  # said before the model loads (the engine checks them too)
        given, n = len(args.priority), len(prompts)
        if given != n:
            raise ValueError(f"--priority given {given} times for {n} prompts (one per --prompt)")
        if any(args.priority) and args.scheduling_policy != "priority":
            raise ValueError("--priority other than 0 needs --scheduling-policy priority")
    llm = _llm(args)
    params = sampling_params_from_args(args)
    if args.raw:
        outs = llm.generate(prompts, params, priority=args.priority)
    else:
        convs = [[{"role": "user", "content": p}] for p in prompts]
        outs = llm.chat(convs, params, priority=args.priority)
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
