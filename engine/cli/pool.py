"""``engine pool serve|stats|clear``: run a pool service, or ask one for its counters or to drop
its blocks (added to the command line by engine/cli/main.py)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

DEFAULT_PORT = 7600
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_pool_commands(subparsers) -> None:
    pool = subparsers.add_parser("pool", help="the KV pool service (one per host)")
    sub = pool.add_subparsers(dest="pool_command", required=True)

    s = sub.add_parser("serve", help="run the pool service: lend this host's DRAM and SSD")
    s.add_argument("--dram", default=None, help="DRAM arena per namespace, e.g. 4GiB")
    s.add_argument("--ssd", default=None, help="PATH:SIZE, records under PATH, e.g. /var/kv:50GiB")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--events-port", type=int, default=None, help="PUB socket for stored/removed")
    s.add_argument("--policy", default="lru", help="eviction policy: lru, lfu or length")
    s.add_argument("--lease", type=float, default=10.0, help="seconds a shm lease may last")
    s.add_argument("--max-namespaces", type=int, default=4)
    s.add_argument("--workers", type=int, default=2, help="threads running store operations")
    s.add_argument(
        "--max-frame-bytes", default="64MiB", help="largest data frame accepted (a block record)"
    )
    s.add_argument(
        "--mooncake",
        default=None,
        help="lend memory to a Mooncake Store (alone, without --dram/--ssd: only that): "
        "mooncake://HOST:RPC_PORT?metadata=URL&segment=SIZE",
    )
    s.set_defaults(func=cmd_serve)

    for name, text in (("stats", "print a pool service's counters"), ("clear", "drop its blocks")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--address", default=f"tcp://127.0.0.1:{DEFAULT_PORT}")
        c.add_argument("--namespace", default="", help="namespace id (hex); default: all")
        c.add_argument("--timeout", type=float, default=5.0)
        c.set_defaults(func=cmd_admin)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.kvstore.eviction import POLICIES
    from engine.kvstore.service.server import PoolService, PoolServiceConfig
    from engine.pool_spec import parse_size

    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    if args.policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {args.policy!r}")
    ssd_path, ssd_bytes = None, 0
    if args.ssd:
        ssd_path, sep, size = args.ssd.rpartition(":")
        if not sep or not ssd_path:
            raise ValueError(f"--ssd must be PATH:SIZE, got {args.ssd!r}")
        ssd_bytes = parse_size(size, "--ssd size")
    lend_only = args.mooncake and not args.dram and not args.ssd
    config = None
    if not lend_only:
        config = PoolServiceConfig(
            port=args.port,
            dram_bytes=parse_size(args.dram, "--dram") if args.dram else 0,
            ssd_path=ssd_path,
            ssd_bytes=ssd_bytes,
            host=args.host,
            events_port=args.events_port,
            policy=args.policy,
            lease_s=args.lease,
            max_namespaces=args.max_namespaces,
            workers=args.workers,
            max_frame_bytes=parse_size(args.max_frame_bytes, "--max-frame-bytes"),
        )
    lender = _lender(args.mooncake) if args.mooncake else None
    try:
        if lend_only:  # only lend memory to the Mooncake Store, until SIGTERM/SIGINT
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            print(f"mooncake lender ready: {lender.spec.segment} bytes", flush=True)
            while not stop.wait(1.0):
                pass
            return 0
        service = PoolService(config)
        # Tests and scripts wait for this line: the ports are bound when it is printed.
        events = f" events tcp://{config.host}:{service.events_port}" if service.events_port else ""
        print(f"pool service ready on tcp://{config.host}:{service.port}{events}", flush=True)
        service.serve()
        return 0
    finally:
        if lender is not None:
            lender.close()


def _lender(url: str):
    from engine.kvstore.mooncake_tier import lend_memory
    from engine.pool_spec import MooncakeSpec, parse_pool_spec

    spec = parse_pool_spec(url).remote
    if not isinstance(spec, MooncakeSpec):
        raise ValueError(f"--mooncake must be mooncake://HOST:RPC_PORT?metadata=URL, got {url!r}")
    return lend_memory(spec)


def cmd_admin(args: argparse.Namespace) -> int:
    import zmq

    from engine.kvstore.service import protocol as P

    try:
        namespace = bytes.fromhex(args.namespace)
    except ValueError:
        raise ValueError(
            f"--namespace must be a namespace id in hex, got {args.namespace!r}"
        ) from None
    if namespace and len(namespace) != P.NAMESPACE_LEN:
        raise ValueError(f"--namespace must be {P.NAMESPACE_LEN} bytes (hex), got {len(namespace)}")
    msg = (P.Stats if args.pool_command == "stats" else P.Clear)(id=1, namespace=namespace)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        from engine.ipc import curve

        curve.secure_client(sock)
        sock.connect(args.address)
        sock.send_multipart(P.encode(msg))
        deadline = time.monotonic() + args.timeout
        while sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
            reply = P.decode(sock.recv_multipart())
            if reply.id != msg.id:
                continue
            if isinstance(reply, P.Error):
                print(f"error: {reply.error}", file=sys.stderr)
                return 1
            if isinstance(reply, P.StatsOk):
                print(json.dumps(reply.stats, indent=2, sort_keys=True))
            else:
                print(f"cleared {reply.count} blocks")
            return 0
        print(f"error: no reply from {args.address} within {args.timeout}s", file=sys.stderr)
        return 1
    finally:
        sock.close(linger=0)
        ctx.term()
