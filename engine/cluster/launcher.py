"""Starting a cluster on one host: the router in this process, N prefill and M decode workers as
child processes (``engine worker --role ...`` on their command lines, so ``ps`` tells them
apart), each with its own torch thread count. ``Cluster.stop`` (also on Ctrl-C or SIGTERM of
``engine cluster``) terminates every child, kills what does not exit, and removes their staging
files: no orphans.

Start-up fails fast: while the workers register, the launcher polls its children, and one that
exits stops the others and raises ``ChildExited`` naming it (role, exit code, the last lines of
its standard error, which is also passed through to ours) within a second, instead of waiting out
the start timeout."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

from engine.ipc.ports import free_port

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20  # kept per child, for the error when it exits at start-up


class ChildExited(RuntimeError):
    """A worker or the pool service exited while the cluster was starting."""


class _Child:
    """A child process whose standard error is passed through to ours line by line, the last
    ``STDERR_TAIL_LINES`` of it kept (bounded) for the error message if it exits early."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._pump = threading.Thread(target=self._relay, name=f"stderr-{name}", daemon=True)
        self._pump.start()

    def _relay(self) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for line in iter(self.proc.stderr.readline, b""):
            self.tail.append(line.decode(errors="replace").rstrip())
            try:
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stderr.write(line.decode(errors="replace"))
            except (OSError, ValueError):  # our stderr closed: keep draining the pipe
                out = None
        self.proc.stderr.close()

    def exited(self) -> ChildExited | None:
        """The error to raise if the process has exited, else None."""
        code = self.proc.poll()
        if code is None:
            return None
        self._pump.join(2)  # the rest of its output
        tail = "\n".join(f"    {line}" for line in self.tail) or "    (nothing)"
        return ChildExited(
            f"{self.name} (pid {self.proc.pid}) exited with code {code} while the cluster was "
            f"starting; the last lines of its stderr:\n{tail}"
        )


class Cluster:
    """The router (in this process) and its worker processes."""

    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        worker_args: list[str] | None = None,
        router_config=None,
        kv_transport: str = "shm",
        threads: int = 1,
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
        pool_service: str | None = None,
        worker_gpus: dict[str, list[str]] | None = None,
        prefill_groups: int = 0,
        stages: int = 2,
    ) -> None:
        """pool_service: "dram=SIZE[,ssd=PATH:SIZE]": one pool service for the host (``engine pool
        serve``), which every worker uses as its KV pool (``--kv-pool tcp://...``).
        worker_gpus: options added to a worker's command line by worker id (its ``--device
        cuda:I --gpu-memory-utilization U``: engine/cluster/gpu_placement.py), kept for its
        restarts.
        prefill_groups: pipelined prefill groups of ``stages`` workers each (``group-G`` of
        workers ``group-G-stage-I``), beside the ``prefill`` workers alone."""
        from dataclasses import replace

        from engine.cluster.router.router import Router, RouterConfig

        if prefill < 0 or decode < 1 or prefill_groups < 0:
            raise ValueError(
                f"--prefill and --prefill-groups must be >= 0 and --decode >= 1, got "
                f"{prefill}, {prefill_groups} and {decode}"
            )
        if prefill + prefill_groups < 1:
            raise ValueError("a cluster needs --prefill >= 1 or --prefill-groups >= 1")
        if prefill_groups and not 2 <= stages <= 64:
            raise ValueError(f"--stages must be in [2, 64], got {stages}")
        cfg = router_config or RouterConfig()
        if cfg.address.endswith(":0"):
            cfg = replace(cfg, address=f"tcp://127.0.0.1:{free_port()}")
        self.router = Router(cfg)
        self.worker_args = list(worker_args or [])
        self.worker_gpus = dict(worker_gpus or {})
        self.stage_args: dict[str, list[str]] = {}  # a group's stage: --group, --stage
        self.kv_transport = kv_transport
        self.threads = threads
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.children: dict[str, _Child] = {}
        self.pids: list[int] = []  # every worker ever started (their staging files go at stop)
        self.pool_address = ""
        try:
            if pool_service:
                if any(a == "--kv-pool" for a in self.worker_args):
                    raise ValueError("give either --pool-service or --kv-pool, not both")
                self.pool_address = self._start_pool(pool_service, start_timeout)
                self.worker_args += ["--kv-pool", self.pool_address]
            for i in range(prefill):
                self.start_worker("prefill", f"prefill-{i}")
            for g in range(prefill_groups):
                for i in range(stages):
                    wid = f"group-{g}-stage-{i}"  # (cli/cluster.py's worker_gpus names it too)
                    self.stage_args[wid] = ["--group", f"group-{g}", "--stage", f"{i}/{stages}"]
                    self.start_worker("prefill", wid)
            for i in range(decode):
                self.start_worker("decode", f"decode-{i}")
            self.router.wait_for_workers(
                prefill, decode, start_timeout, check=self.check_children, groups=prefill_groups
            )
        except BaseException:
            self.stop()
            raise

    def _start_pool(self, spec: str, timeout: float) -> str:
        args = []
        for part in spec.split(","):
            key, _, value = part.strip().partition("=")
            if key not in ("dram", "ssd") or not value:
                raise ValueError(
                    f"--pool-service takes dram=SIZE and ssd=PATH:SIZE, got {part.strip()!r}"
                )
            args += [f"--{key}", value]
        port, events = free_port(), free_port()
        cmd = [sys.executable, "-m", "engine", "pool", "serve", *args, "--port", str(port),
               "--events-port", str(events)]  # fmt: skip
        child = _Child("the pool service", cmd, dict(os.environ if self.env is None else self.env))
        self.children["pool"] = child
        self.procs["pool"] = child.proc
        deadline = time.monotonic() + timeout
        while True:  # until it accepts connections
            if (err := child.exited()) is not None:
                raise err
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                self.router.add_pool(f"pool@127.0.0.1:{port}", f"tcp://127.0.0.1:{events}")
                return f"tcp://127.0.0.1:{port}"
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the pool service did not start") from None
                time.sleep(0.2)

    def check_children(self) -> None:
        """Raise ``ChildExited`` for the first child (worker or pool service) that has exited."""
        for child in list(self.children.values()):
            if (err := child.exited()) is not None:
                raise err

    def worker_command(self, role: str, worker_id: str) -> list[str]:
        args = self.worker_args
        if worker_id in self.stage_args:  # a group's stage runs without a KV pool
            args = _without(args, "--kv-pool")
        return [
            sys.executable,
            "-m",
            "engine",
            "worker",
            "--role",
            role,
            "--router",
            self.router.address,
            "--worker-id",
            worker_id,
            "--kv-transport",
            self.kv_transport,
            "--threads",
            str(self.threads),
            *args,
            *self.worker_gpus.get(worker_id, []),
            *self.stage_args.get(worker_id, []),
        ]

    def start_worker(self, role: str, worker_id: str) -> subprocess.Popen:
        """Start (or restart, under the same name) a worker process."""
        from engine.cluster.transfer.staging import remove_stale_arenas

        old = self.procs.get(worker_id)
        if old is not None:
            if old.poll() is None:
                raise ValueError(f"worker {worker_id} is still running (pid {old.pid})")
            remove_stale_arenas([old.pid])
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        child = _Child(f"{role} worker {worker_id}", self.worker_command(role, worker_id), env)
        self.children[worker_id] = child
        proc = self.procs[worker_id] = child.proc
        self.pids.append(proc.pid)
        return proc

    def stop(self, timeout: float = 20.0) -> None:
        from engine.cluster.transfer.staging import remove_stale_arenas

        pool = self.procs.pop("pool", None)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        remove_stale_arenas(self.pids)
        if pool is not None:  # after the workers: they may still write to it while draining
            if pool.poll() is None:
                pool.send_signal(signal.SIGTERM)
            try:
                pool.wait(timeout)
            except subprocess.TimeoutExpired:
                pool.kill()
                pool.wait(10)
        self.router.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _without(args: list[str], option: str) -> list[str]:
    """``args`` less ``option`` and its value (either form: ``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out
