"""``engine serve`` (the OpenAI-compatible HTTP server) and ``engine rpc`` (the ZeroMQ RPC
server), added to the command line by cli.py."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli.engine_options import engine_config_from_args


def add_server_commands(subparsers, engine_args_fn) -> None:
    s = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    engine_args_fn(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer <key> on every route but /health "
        "(default: the ENGINE_API_KEY environment variable, if set)",
    )
    s.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="model name(s) clients use (repeat for aliases; default: the --model value)",
    )
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="do not serve /openapi.json, /docs and /redoc (served by default, as in vLLM)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open connections at most (per client address: twice --max-pending-per-client, "
        "at least 64, at most half); beyond, stalled "
        "readers are closed, then new connections get 429",
    )
    s.add_argument(
        "--max-pending-per-client",
        type=int,
        default=None,
        help="generation requests one client address may have in flight; beyond, 429 "
        f"(default: {DEFAULT_PER_CLIENT}, or --max-pending if lower; 0: no per-client cap)",
    )
    add_tool_call_parser(s)
    add_responses_store_size(s)
    _common(s)
    s.set_defaults(func=cmd_serve)

    r = subparsers.add_parser("rpc", help="serve the ZeroMQ RPC API (engine.client.RPCClient)")
    engine_args_fn(r)
    r.add_argument("--address", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint to bind")
    r.add_argument("--max-inflight", type=int, default=1024, help="calls in flight at most")
    _common(r)
    r.set_defaults(func=cmd_rpc)


def add_tool_call_parser(p: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``, for every command that serves chat completions over HTTP."""
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "generic"],
        help="the tool-call format of the model's replies (docs/tool_calls.md; default: read "
        "from the chat template: hermes for Qwen-style, llama3_json for Llama 3.x, else generic)",
    )


def add_responses_store_size(p: argparse.ArgumentParser) -> None:
    """``--responses-store-size``, for every command that serves /v1/responses over HTTP."""
    from engine.server.responses.store import DEFAULT_STORE_SIZE

    p.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_STORE_SIZE,
        help="/v1/responses kept in memory for previous_response_id and GET, the oldest "
        f"evicted first (default {DEFAULT_STORE_SIZE}; 0: none kept)",
    )


def responses_config(args: argparse.Namespace):
    """The ResponsesConfig of --responses-store-size (ValueError naming its limits)."""
    from engine.server.responses.store import ResponsesConfig

    try:
        return ResponsesConfig(store_size=args.responses_store_size)
    except ValueError as exc:
        raise ValueError(f"--responses-store-size: {exc}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM before they are aborted",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="requests in flight before new ones get 429 (default: half of --max-connections "
        "for serve, --max-inflight for rpc)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def make_engine(args: argparse.Namespace):
    """The AsyncLLM that ``engine serve`` and ``engine rpc`` serve, built from their parsed
    arguments (the engine options and --max-pending, which ``check_limits`` has filled in); sets
    up logging at --log-level first. profiling/bench_startup.py times it."""
    from engine.async_llm import AsyncLLM

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_pending is not None and args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    return AsyncLLM(config=engine_config_from_args(args), max_pending=args.max_pending)


# One client's share of the admission queue: small enough that a flood from one address keeps
# the engine's steps small (profiling/bench_abuse.py flood), large enough for a batch client.
DEFAULT_PER_CLIENT = 32


def check_limits(args: argparse.Namespace) -> None:
    """Check the admission limits of ``engine serve`` or ``engine rpc`` and fill in their defaults
    in ``args`` (--max-pending, --max-pending-per-client); raises ValueError on a bad one.
    Overload must meet the documented 429 of the admission queue before any other limit:
    requests in flight stay below the connection cap (HTTP) or the calls cap (RPC)."""
    cap, name = (
        (args.max_connections, "--max-connections")
        if args.command == "serve"
        else (args.max_inflight, "--max-inflight")
    )
    if cap < 2:
        raise ValueError(f"{name} must be >= 2, got {cap}")
    if args.max_pending is None:
        args.max_pending = cap // 2 if args.command == "serve" else cap
    elif args.max_pending > cap:
        raise ValueError(f"--max-pending ({args.max_pending}) must be <= {name} ({cap})")
    per_client = getattr(args, "max_pending_per_client", 0)
    if per_client is None:
        args.max_pending_per_client = min(DEFAULT_PER_CLIENT, args.max_pending)
    elif per_client < 0:
        raise ValueError(f"--max-pending-per-client must be >= 0, got {per_client}")


def connections_per_client(max_connections: int, max_pending_per_client: int | None) -> int:
    """Open connections one client address may hold: twice its request cap (room for a stream
    each plus as many idle keep-alive ones), at least 64, at most half of all connections; half
    of all when the request cap is off. A slowloris attacker that reconnects as fast as it is
    closed then holds few connections and the rest of its attempts are reset before parsing
    (with 1,024 per address it kept the event loop busy parsing and answering: the probe's TTFT
    p99 went 6x, against 1.2x with this cap, profiling/bench_abuse.py)."""
    half = max(1, max_connections // 2)
    if not max_pending_per_client:
        return half
    return min(half, max(64, 2 * max_pending_per_client))


def cmd_serve(args: argparse.Namespace) -> int:
    from engine import envs
    from engine.server.http_limits import HTTPLimits
    from engine.server.uvicorn_server import bind_socket, serve_http

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_limits(args)
    responses = responses_config(args)
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails now
    try:
        llm = make_engine(args)
    except BaseException:
        sock.close()
        raise
    names = args.served_model_name or [args.model]
    key = args.api_key or envs.api_key()
    host = f"[{args.host}]" if ":" in args.host else args.host
    auth = ' -H "Authorization: Bearer $ENGINE_API_KEY"' if key else ""
    body = (
        f'{{"model": "{names[0]}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}'
    )
    print(
        f"Serving {names[0]} on http://{host}:{args.port}/v1 (OpenAI-compatible).\n"
        f"  curl http://{host}:{args.port}/v1/chat/completions"
        f" -H 'Content-Type: application/json'{auth} -d '{body}'",
        file=sys.stderr,
        flush=True,
    )
    return serve_http(
        llm,
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_key=key,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
        limits=HTTPLimits(
            max_connections=args.max_connections,
            max_connections_per_client=connections_per_client(
                args.max_connections, args.max_pending_per_client
            ),
        ),
        sock=sock,
        enable_docs=not args.disable_fastapi_docs,
        model_root=args.model,
        max_pending_per_client=args.max_pending_per_client or None,
        tool_call_parser=args.tool_call_parser,
        responses=responses,
    )


def cmd_rpc(args: argparse.Namespace) -> int:
    from engine.server.rpc_server import check_address, serve_rpc

    check_limits(args)
    check_address(args.address)  # before the model loads: a bad or taken address fails now
    llm = make_engine(args)
    print(
        f"RPC server on {args.address}. From Python:\n"
        f"  from engine.client import RPCClient\n"
        f"  client = RPCClient({args.address!r})\n"
        f"  print(client.generate('The capital of France is', max_tokens=16, "
        "temperature=0.2, top_p=0.9).text)",
        file=sys.stderr,
        flush=True,
    )
    return serve_rpc(
        llm,
        address=args.address,
        drain_timeout=args.drain_timeout,
        model_name=args.model,
        max_inflight=args.max_inflight,
    )
