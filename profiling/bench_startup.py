"""How long `engine serve` takes to become healthy: the first start (an empty weight cache: the
GGUF is dequantized and the cache written) and later starts (the cache is mapped), with a
breakdown of where the time goes.

    .venv/bin/python profiling/bench_startup.py                  # default model and arguments
    .venv/bin/python profiling/bench_startup.py --repeats 5 --serve-args "--dtype float32"

Each start is a fresh `python -m engine serve` on a free port of 127.0.0.1, timed from the
spawn to the first 200 of /health (polled every 10 ms). The breakdown comes from a second set of
fresh processes that run the same start-up steps as `engine serve` with a timer around each
(profiling/bench_startup.py --stages): interpreter and `import torch`, the server's other
imports, the model (checkpoint metadata and tokenizer, then the weights), the rest of the
engine (KV cache, scheduler, runner), and uvicorn until it listens. The weight cache lives in a
temporary directory, so ~/.cache is neither used nor touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from engine.ipc.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_to_healthy(serve_args: list[str], env: dict, timeout: float = 300.0) -> float:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port), *serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}/health"
    try:
        with httpx.Client(timeout=1.0) as client:
            while time.perf_counter() - t0 < timeout:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"engine serve exited with {proc.returncode}:\n{err}")
                try:
                    if client.get(url).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
        raise RuntimeError(f"engine serve not healthy within {timeout:.0f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stages(serve_args: list[str], env: dict) -> dict[str, float]:
    """The breakdown of one start, from a fresh process running ``--stages``."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--stages", "--serve-args", *serve_args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    total = time.perf_counter() - t0
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process total"] = total
    return result


def _run_stages(serve_args: list[str]) -> None:
    """Child: the steps of cmd_serve with a timer around each; prints one JSON line."""
    started = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        marks[name] = now - since
        return now

    t = time.perf_counter()
    import torch  # noqa: F401

    t = mark("import torch", t)
    import engine.cli.serve as commands
    from engine.cli.main import main  # noqa: F401  (what `python -m engine` imports)
    from engine.server.http_server import build_app
    from engine.server.uvicorn_server import bind_socket, uvicorn_config

    t = mark("other imports", t)
    import engine.core.engine_setup as engine_setup
    import engine.model.builder as model_builder

    timers = {"checkpoint": 0.0, "weights": 0.0}
    original_open = model_builder.open_checkpoint
    original_build = engine_setup.build_model

    def timed_open(*a, **kw):
        t1 = time.perf_counter()
        try:
            return original_open(*a, **kw)
        finally:
            timers["checkpoint"] += time.perf_counter() - t1

    def timed_build(*a, **kw):
        t1 = time.perf_counter()
        try:
            return original_build(*a, **kw)
        finally:
            timers["weights"] += time.perf_counter() - t1 - timers["checkpoint"]

    model_builder.open_checkpoint = timed_open
    engine_setup.build_model = timed_build
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    from engine.cli.engine_options import add_engine_options

    commands.add_server_commands(sub, add_engine_options)
    args = parser.parse_args(["serve", "--port", "0", *serve_args])
    commands.check_limits(args)
    sock = bind_socket(args.host, 0)
    t = time.perf_counter()
    llm = commands.make_engine(args)
    engine_s = time.perf_counter() - t
    marks["model: checkpoint + tokenizer"] = timers["checkpoint"]
    marks["model: weights"] = timers["weights"]
    marks["engine: KV cache, scheduler, runner"] = (
        engine_s - timers["checkpoint"] - timers["weights"]
    )
    marks["weight cache"] = "hit" if llm.engine.weight_cache_hit else "miss"
    t = time.perf_counter()
    import asyncio

    import uvicorn

    app = build_app(llm, [args.model], shutdown_engine=True)
    server = uvicorn.Server(uvicorn_config(app, log_level="error"))

    async def up() -> None:
        server.config.load()  # as uvicorn.Server._serve does
        server.lifespan = server.config.lifespan_class(server.config)
        await server.startup(sockets=[sock])
        mark("uvicorn until listening", t)
        marks["in-process total"] = time.perf_counter() - started
        await server.shutdown()

    asyncio.run(up())
    llm.close()
    print(json.dumps(marks))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="cached starts to time")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    serve_args = args.serve_args
    if len(serve_args) == 1:
        serve_args = shlex.split(serve_args[0])
    if args.stages:
        _run_stages(serve_args)
        return
    with tempfile.TemporaryDirectory(prefix="engine-bench-startup-") as cache:
        env = dict(os.environ, ENGINE_WEIGHT_CACHE_DIR=cache, PYTHONPATH=ROOT)
        env.pop("ENGINE_WEIGHT_CACHE", None)
        print("serve args:", " ".join(serve_args) or "(defaults)", flush=True)
        first = time_to_healthy(serve_args, env)
        print(f"first start (empty weight cache): healthy after {first:.2f} s", flush=True)
        later = [time_to_healthy(serve_args, env) for _ in range(args.repeats)]
        print("later starts:", ", ".join(f"{x:.2f} s" for x in later), flush=True)
        off_env = dict(env, ENGINE_WEIGHT_CACHE="0")
        off = time_to_healthy(serve_args, off_env)
        print(f"weight cache off: healthy after {off:.2f} s", flush=True)
        breakdown = {"cache off": stages(serve_args, off_env), "cached": stages(serve_args, env)}
    later.sort()
    print("\n| start | time to /health 200 |")
    print("| --- | --- |")
    print(f"| first (writes the weight cache) | {first:.2f} s |")
    print(f"| later (maps it), median of {len(later)} | {later[len(later) // 2]:.2f} s |")
    print(f"| weight cache off | {off:.2f} s |")
    names = [k for k in breakdown["cached"] if k != "weight cache"]
    print("\n| stage | cache off | cached |")
    print("| --- | --- | --- |")
    for name in names:
        row = [breakdown[c].get(name, float("nan")) for c in ("cache off", "cached")]
        print(f"| {name} | " + " | ".join(f"{x:.2f} s" for x in row) + " |")


if __name__ == "__main__":
    main()
