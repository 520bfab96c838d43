"""``engine worker``, ``engine router`` and ``engine cluster`` (disaggregated prefill and decode),
added to the command line by cli.py.

- ``engine cluster --prefill N --decode M [serve options]``: the router (in this process) behind
  the OpenAI HTTP server on ``--port`` (and the ZeroMQ RPC API with ``--rpc-address``), N prefill
  and M decode worker processes on this host. SIGTERM or Ctrl-C stops them all.
- ``engine router --address tcp://HOST:PORT [--kv-pool tcp://HOST:PORT] [serve options]``: the
  router alone (and the pool service started on its own that it hears), for workers started one
  by one (on other hosts too) with
- ``engine worker --role prefill|decode --router tcp://HOST:PORT [engine options]``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli.engine_options import engine_argv, engine_config_from_args, set_options

POOL_WAIT_S = 60.0  # engine router --kv-pool: how long the pool service may take to answer


def add_cluster_commands(subparsers, engine_args_fn) -> None:
    w = subparsers.add_parser("worker", help="a prefill or decode worker of a cluster")
    engine_args_fn(w)
    w.add_argument("--role", required=True, choices=["prefill", "decode"])
    w.add_argument("--router", required=True, help="the router's endpoint, tcp://HOST:PORT")
    w.add_argument("--worker-id", default="", help="a stable name (default: role + random)")
    w.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address every socket other hosts reach binds: KV (decode), block events, block "
        "copies (prefill), Mooncake's Transfer Engine",
    )
    w.add_argument("--kv-staging-mb", type=int, default=1024, help="decode: KV staging arena")
    w.add_argument(
        "--group",
        default="",
        metavar="NAME",
        help="prefill: a stage of the pipelined prefill group NAME (with --stage)",
    )
    w.add_argument(
        "--stage",
        default=None,
        metavar="I/N",
        help="prefill: stage I (from 0) of the group's N; it loads only its layers",
    )
    _worker_options(w)
    w.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    w.set_defaults(func=cmd_worker)

    r = subparsers.add_parser("router", help="the cluster's router behind the HTTP server")
    r.add_argument("--model", default="default")
    r.add_argument("--address", default="tcp://127.0.0.1:5557", help="control endpoint to bind")
    r.add_argument("--block-size", type=int, default=16, help="the workers' KV block size")
    r.add_argument(
        "--kv-pool",
        default=None,
        metavar="tcp://HOST:PORT",
        help="a pool service started with engine pool serve --events-port (the workers' "
        "--kv-pool): the router hears its block events and places by what it holds",
    )
    r.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="priority: requests may carry a priority (lower first), which the Conductor's "
        "queues and rejection order by and the workers are sent (start them with "
        "--scheduling-policy priority too); fcfs: a priority other than 0 is a 400",
    )
    _router_args(r)
    r.set_defaults(func=cmd_router)

    c = subparsers.add_parser("cluster", help="router + N prefill + M decode workers, one host")
    engine_args_fn(c)
    c.add_argument(
        "--prefill", type=int, default=1, help="prefill workers alone (0 with --prefill-groups)"
    )
    c.add_argument("--decode", type=int, default=1, help="decode workers")
    c.add_argument(
        "--prefill-groups",
        type=int,
        default=0,
        metavar="G",
        help="pipelined prefill groups (chunked pipeline parallelism), each of --stages workers",
    )
    c.add_argument("--stages", type=int, default=2, metavar="N", help="stages per prefill group")
    c.add_argument("--kv-staging-mb", type=int, default=1024)
    c.add_argument("--worker-timeout", type=float, default=300.0, help="seconds to register")
    c.add_argument(
        "--pool-service",
        default=None,
        metavar="SPEC",
        help='one KV pool service for the host, used by every worker: "dram=4GiB,ssd=PATH:50GiB"',
    )
    c.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="spread the workers round-robin over the first N visible GPUs (default: all), "
        "each GPU's --gpu-memory-utilization split evenly among its workers; 1: every worker "
        "on cuda:0 (docs/cluster.md)",
    )
    _worker_options(c)
    _router_args(c)
    c.set_defaults(func=cmd_cluster)


def _worker_options(p: argparse.ArgumentParser) -> None:
    """The worker options that ``engine cluster`` also takes and passes on."""
    p.add_argument("--kv-transport", default="shm", choices=["shm", "tcp", "mooncake"])
    p.add_argument(
        "--mooncake-metadata",
        default="P2PHANDSHAKE",
        metavar="URL",
        help="Mooncake metadata service for --kv-transport mooncake (default: peer handshake)",
    )
    p.add_argument("--kv-load-failure", default="recompute", choices=["recompute", "fail"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")


def _router_args(p: argparse.ArgumentParser) -> None:
    from engine.cli.serve import _common, add_responses_store_size, add_tool_call_parser

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", action="append", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--rpc-address", default=None, help="also serve the ZeroMQ RPC API here")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument(
        "--transfer-deadline",
        type=float,
        default=120.0,
        help="seconds a decode worker waits for a request's KV, then applies "
        "--kv-load-failure (recompute or fail)",
    )
    p.add_argument("--no-layer-streaming", action="store_true", help="send KV after prefill")
    add_tool_call_parser(p)
    add_responses_store_size(p)
    _placement_args(p)
    _common(p)


def _placement_args(p: argparse.ArgumentParser) -> None:
    from engine.cluster.conductor.conductor import POLICIES
    from engine.cluster.conductor.rejection import REJECTIONS

    p.add_argument("--policy", default="kvcentric", choices=POLICIES, help="placement")
    p.add_argument("--rejection", default="predicted", choices=REJECTIONS, help="early rejection")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds (rejection)")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="seconds (rejection)")


def placement_config(args: argparse.Namespace) -> dict:
    """The router's placement fields from the command line (RouterConfig)."""
    return dict(
        policy=args.policy,
        rejection=args.rejection,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        block_size=args.block_size,
    )


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from engine.cluster.worker.worker import run_worker
    from engine.cluster.worker.worker_config import WorkerConfig
    from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

    _logging(args.log_level)
    try:
        stage = PipelineStage.parse(args.stage) if args.stage is not None else WHOLE_MODEL
    except ValueError as e:
        print(f"error: --stage: {e}", file=sys.stderr)
        return 2
    cfg = WorkerConfig(
        role=args.role,
        router=args.router,
        engine=engine_config_from_args(args).with_overrides(show_progress=False),
        worker_id=args.worker_id,
        transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_load_failure=args.kv_load_failure,
        staging_mb=args.kv_staging_mb,
        threads=args.threads,
        mooncake_metadata=args.mooncake_metadata,
        group=args.group,
        stage=stage,
    )
    return run_worker(cfg)


def _router_config(args: argparse.Namespace, address: str):
    from engine.cli.serve import responses_config
    from engine.cluster.router.router import RouterConfig

    if args.max_pending is not None and args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    responses_config(args)  # checked before any worker starts
    pending = {} if args.max_pending is None else {"max_pending": args.max_pending}
    return RouterConfig(
        address=address,
        model=args.model,
        heartbeat_timeout_s=args.heartbeat_timeout,
        transfer_deadline_s=args.transfer_deadline,
        stream_layers=not args.no_layer_streaming,
        scheduling_policy=args.scheduling_policy,
        **pending,
        **placement_config(args),
    )


def _serve(router, args: argparse.Namespace) -> int:
    """HTTP (and RPC) on top of the router until SIGTERM/SIGINT."""
    from engine import envs
    from engine.cli.serve import responses_config

    names = args.served_model_name or [args.model]
    if args.rpc_address:
        import asyncio
        import threading

        from engine.server.rpc_server import RPCServer

        rpc = RPCServer(router, args.rpc_address, model_name=names[0], shutdown_engine=False)
        threading.Thread(target=lambda: asyncio.run(rpc.serve()), daemon=True).start()
    from engine.server.uvicorn_server import serve_http

    print(f"Cluster serving {names[0]} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    return serve_http(
        router,
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_key=args.api_key or envs.api_key(),
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        responses=responses_config(args),
    )


def cmd_router(args: argparse.Namespace) -> int:
    from engine.cluster.router.router import Router

    _logging(args.log_level)
    link = None
    if args.kv_pool:
        from engine.cluster.router.pool_link import discover

        link = discover(args.kv_pool, POOL_WAIT_S)
    router = Router(_router_config(args, args.address))
    if link is not None:
        router.add_pool(link.source, link.events_address)
        print(f"Router hears the pool service {link.source}", file=sys.stderr, flush=True)
    print(f"Router control endpoint: {router.address}", file=sys.stderr, flush=True)
    try:
        return _serve(router, args)
    finally:
        router.close()


# The engine options the launcher sets per worker when it places workers on GPUs.
PLACED_OPTIONS = ("device", "gpu_memory_utilization")


def worker_argv(args: argparse.Namespace, placed: bool = False) -> list[str]:
    """What ``engine cluster`` passes on to each ``engine worker`` (beyond role, router, id,
    transport and threads, which the launcher adds): the engine and worker options that were set,
    the staging size and the log level; ``placed``: not the device and memory share, which the
    launcher gives each worker (``worker_gpus``)."""

    return (
        engine_argv(args, skip=PLACED_OPTIONS if placed else ())
        + set_options(args, _worker_options, skip=("kv_transport", "threads"))
        + ["--kv-staging-mb", str(args.kv_staging_mb), "--log-level", args.log_level]
    )


def worker_gpus(args: argparse.Namespace, visible_gpus: int) -> dict[str, list[str]] | None:
    """Each worker's ``--device cuda:I --gpu-memory-utilization U`` by worker id
    (engine/cluster/gpu_placement.py), or None where the workers run on the CPU."""
    from engine.cluster.gpu_placement import worker_gpu_argv

    return worker_gpu_argv(
        args.prefill,
        args.decode,
        visible_gpus,
        args.device,
        args.gpu_memory_utilization,
        args.gpus,
        stage_ids=[
            f"group-{g}-stage-{i}" for g in range(args.prefill_groups) for i in range(args.stages)
        ],
    )


def cmd_cluster(args: argparse.Namespace) -> int:
    import torch

    from engine.cluster.launcher import ChildExited, Cluster

    _logging(args.log_level)
    try:
        gpus = worker_gpus(args, torch.cuda.device_count())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cluster = Cluster(
            args.prefill,
            args.decode,
            worker_args=worker_argv(args, placed=gpus is not None),
            worker_gpus=gpus,
            router_config=_router_config(args, "tcp://127.0.0.1:0"),
            kv_transport=args.kv_transport,
            threads=args.threads,
            start_timeout=args.worker_timeout,
            pool_service=args.pool_service,
            prefill_groups=args.prefill_groups,
            stages=args.stages,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ChildExited, TimeoutError) as e:
        print(f"error: engine cluster did not start: {e}", file=sys.stderr)
        return 1
    try:
        return _serve(cluster.router, args)
    finally:
        cluster.stop()
