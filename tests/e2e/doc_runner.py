"""Runs the fenced ``bash`` and ``python`` blocks of a Markdown file as written, for
tests/e2e/test_docs.py (whose docstring describes the markers). Importable on its own:
``run_markdown(path, tmp_dir)`` runs every block of any Markdown file and returns one result per
step, which is what the negative control of test_docs.py does.

A block runs from the repository root, a bash block as ``bash -e -o pipefail FILE`` and a python
block as ``python FILE`` with this interpreter, each in a session of its own, its output in a
log. It passes when it exits 0 and leaves no process and no /dev/shm file of its own behind. The
only changes to what is written: the documented ports (DOC_PORTS) become free ports, the same
ones for every block until a server block takes fresh ones for the ports it serves; paths under
/tmp, /var/cache and /etc become paths under a directory of the block's section; and
ENGINE_TEST_MAX_TOKENS caps every request's generation length (engine/envs.py). ``make`` reads
the port of ``make run`` from its PORT variable, which is set to the port that stands for 8000;
a block that runs ``make`` skips when .venv is out of date (make would reinstall it first).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from engine.ipc.ports import free_port

REPO = Path(__file__).resolve().parents[2]
LANGS = ("bash", "python")
MAX_TOKENS = 16  # ENGINE_TEST_MAX_TOKENS for every block
BLOCK_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0  # a cluster's workers load the model side by side on 2 busy cores
STOP_TIMEOUT_S = 60.0
LEFTOVER_TIMEOUT_S = 20.0

# name -> "flag" (no value), "value" (a value is required) or "optional"
MARKERS = {"server": "optional", "skip": "value", "slow": "flag", "stdin": "value"}
MARKER_RE = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
MARKER_ITEM_RE = re.compile(r'([a-z]+)(?:="([^"]*)")?(?=\s|$)|(\S+)')
FENCE_RE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)")
HEADING_RE = re.compile(r"^(#{1,6})\s+\S")

# The ports the documentation uses (engine serve/cluster, engine rpc, a router's control socket,
# the pool service and its events, Mooncake's metadata, metrics and RPC ports).
DOC_PORTS = (8000, 5555, 5557, 7600, 7601, 8080, 9003, 50051)
PORT_RE = re.compile(r"(?<![\w.])(" + "|".join(map(str, DOC_PORTS)) + r")(?![\w.])")
TMP_RE = re.compile(r"(?<![\w./~-])(/tmp|/var/cache|/etc)(?=/)")
MAKE_RE = re.compile(r"(?:^|[\s;&|(])make(?:\s|$)", re.M)
SHELLS = ("bash", "sh", "dash", "make")


class DocError(ValueError):
    """A marker that cannot be read or that is not directly above a bash or python block."""


class DocFailure(AssertionError):
    """A block failed: what it did, and the end of its output."""


class DocSkip(Exception):
    """A block did not run, and why."""


@dataclass(eq=False)
class Block:
    name: str  # the file, as shown in test ids (README.md, docs/reliability.md)
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    markers: dict[str, str | None]
    section: int  # index of the innermost heading above it (0: none)
    scope_end: float  # a server runs until this line: the next heading at its section's level

    @property
    def id(self) -> str:
        return f"{self.name}:{self.line}-{self.lang}"

    @property
    def is_server(self) -> bool:
        return "server" in self.markers


@dataclass(eq=False)
class Step:
    """One test: a block, or the stop of a server block at the end of its section."""

    block: Block
    stop: bool = False
    servers: tuple[Block, ...] = ()  # the server blocks that run while this step runs
    skip: str | None = None
    slow: bool = False

    @property
    def id(self) -> str:
        return self.block.id + ("-stop" if self.stop else "")


@dataclass
class Result:
    step: str
    outcome: str  # "passed", "failed" or "skipped"
    message: str = ""


def parse_markers(text: str, where: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for m in MARKER_ITEM_RE.finditer(text.strip()):
        name, value, junk = m.groups()
        if junk is not None or name not in MARKERS:
            raise DocError(
                f"{where}: unknown doc-test marker {(junk or name)!r} (known: "
                f'{", ".join(MARKERS)}; values in double quotes: skip="why")'
            )
        kind = MARKERS[name]
        if kind == "value" and not value:
            raise DocError(f'{where}: doc-test marker {name} needs a value: {name}="..."')
        if kind == "flag" and value is not None:
            raise DocError(f"{where}: doc-test marker {name} takes no value")
        out[name] = value
    if not out:
        raise DocError(f"{where}: empty doc-test marker")
    return out


def parse_markdown(path: Path, name: str | None = None) -> list[Block]:
    """The bash and python blocks of a Markdown file, with their markers and sections."""
    name = name or path.name
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    headings: list[tuple[int, int]] = []  # (line, level)
    level, section = 0, 0
    levels: dict[Block, int] = {}
    pending: tuple[int, dict] | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE_RE.match(line)
        if fence:
            indent, ticks, lang = fence.groups()
            close = re.compile(rf"^ {{0,3}}{re.escape(ticks[0])}{{{len(ticks)},}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            body = "\n".join(ln.removeprefix(indent) for ln in lines[i + 1 : j])
            markers = pending[1] if pending else {}
            if lang in LANGS:
                block = Block(name, i + 1, lang, body + "\n", markers, section, float("inf"))
                blocks.append(block)
                levels[block] = level
            elif pending:
                raise DocError(
                    f"{name}:{pending[0]}: a doc-test marker must stand directly above a bash or "
                    "python block"
                )
            pending = None
            i = j + 1
            continue
        marker = MARKER_RE.match(line)
        if marker:
            if pending:
                raise DocError(f"{name}:{pending[0]}: two doc-test markers: write one")
            pending = (i + 1, parse_markers(marker.group(1), f"{name}:{i + 1}"))
        elif line.strip():
            if pending:
                raise DocError(
                    f"{name}:{pending[0]}: a doc-test marker must stand directly above its block"
                )
            heading = HEADING_RE.match(line)
            if heading:
                level, section = len(heading.group(1)), section + 1
                headings.append((i + 1, level))
        i += 1
    if pending:
        raise DocError(f"{name}:{pending[0]}: a doc-test marker at the end of the file")
    for block in blocks:
        ends = [ln for ln, lv in headings if ln > block.line and lv <= levels[block]]
        block.scope_end = ends[0] if ends and levels[block] else float("inf")
    return blocks


def plan(blocks: list[Block]) -> list[Step]:
    """One step per block, in order, and one after the last block of each server's section that
    stops it. A block in a server's section runs while that server runs; it is skipped (or
    slow) when its server is."""
    steps: list[Step] = []
    active: list[tuple[Block, Step]] = []

    def close(line: float) -> None:
        while active and active[-1][0].scope_end <= line:
            server, start = active.pop()
            steps.append(
                Step(
                    server,
                    stop=True,
                    servers=tuple(b for b, _ in active),
                    skip=start.skip,
                    slow=start.slow,
                )
            )

    for block in blocks:
        close(block.line)
        step = Step(block, servers=tuple(b for b, _ in active))
        for server, start in active:
            if start.skip and not step.skip:
                step.skip = f"runs against {server.id}, which is skipped: {start.skip}"
            step.slow = step.slow or start.slow
        if "skip" in block.markers:
            step.skip = block.markers["skip"]
        step.slow = step.slow or "slow" in block.markers
        steps.append(step)
        if block.is_server:
            active.append((block, step))
    close(float("inf"))
    return steps


def plan_files(paths: list[Path], root: Path = REPO) -> list[Step]:
    steps: list[Step] = []
    for path in paths:
        name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        steps += plan(parse_markdown(path, name))
    return steps


class Tracker:
    """The processes of one block (its session, sampled while it runs) and the /dev/shm files
    they leave."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.sid = proc.pid  # start_new_session: the leader's pid is the session id
        self.procs: dict[int, psutil.Process] = {}
        self.shm_before = set(os.listdir("/dev/shm"))
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.sid)
            for p in [root, *root.children(recursive=True)]:
                self.procs.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def close(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join(5)

    def _alive(self) -> list[psutil.Process]:
        alive = {p.pid: p for p in self.procs.values() if p.is_running()}
        for p in psutil.process_iter():
            try:
                if p.pid not in alive and os.getsid(p.pid) == self.sid:
                    alive[p.pid] = p
                    self.procs.setdefault(p.pid, p)
            except (OSError, psutil.Error):
                pass
        return [p for p in alive.values() if p.is_running() and p.status() != "zombie"]

    def leftovers(self, timeout: float = LEFTOVER_TIMEOUT_S) -> list[str]:
        """Processes still alive after ``timeout`` (then killed), described."""
        _, alive = psutil.wait_procs(self._alive(), timeout=timeout)
        out = []
        for p in alive:
            try:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
                p.kill()
            except psutil.Error:
                pass
        return out

    def shm_leaks(self) -> list[str]:
        """/dev/shm files made since the start whose names carry one of our pids (removed)."""
        pids = set(self.procs)
        leaked = []
        for entry in sorted(set(os.listdir("/dev/shm")) - self.shm_before):
            if any(int(t) in pids for t in re.findall(r"\d+", entry)):
                leaked.append(entry)
                try:
                    os.unlink(os.path.join("/dev/shm", entry))
                except OSError:
                    pass
        return leaked

    def kill_all(self) -> None:
        self.close()
        try:
            os.killpg(self.sid, signal.SIGKILL)
        except OSError:
            pass
        self.leftovers(timeout=5)
        self.shm_leaks()

    def problems(self) -> list[str]:
        """What the block left behind: processes, /dev/shm files (after ``close``)."""
        problems = []
        left = self.leftovers()
        if left:
            problems.append(f"left processes behind: {left}")
        leaks = self.shm_leaks()
        if leaks:
            problems.append(f"left files in /dev/shm: {leaks}")
        return problems


@dataclass(eq=False)
class Server:
    block: Block
    proc: subprocess.Popen
    log: Path
    tracker: Tracker


def _tail(log: Path, chars: int = 4000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return ("...\n" + text[-chars:]) if len(text) > chars else text


def _serving_process(pid: int) -> psutil.Process:
    """The server under the shell (and make) that runs a block: the process to signal."""
    p = psutil.Process(pid)
    while p.name() in SHELLS:
        children = p.children()
        if len(children) != 1:
            break
        p = children[0]
    return p


_mooncake: list[str | None] = []


def _check_mooncake(text: str) -> None:
    """Blocks that use the optional Mooncake backend skip, saying why, where it cannot load
    (the ``mooncake`` extra, or Debian's libibverbs1, is missing)."""
    if "mooncake" not in text:
        return
    if not _mooncake:
        from engine.kvstore.mooncake_tier import MooncakeUnavailable, load_store_class

        why = None
        try:
            load_store_class()
        except MooncakeUnavailable as exc:
            why = str(exc)
        if not os.access(Path(sys.executable).parent / "mooncake_master", os.X_OK):
            why = why or "mooncake_master is not installed (pip install -e '.[mooncake]')"
        _mooncake.append(why)
    if _mooncake[0]:
        raise DocSkip(_mooncake[0])


def _ready(url: str) -> bool:
    if url.startswith(("http://", "https://")):
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", url)
    if not m:
        raise DocError(f"server marker: cannot wait for {url!r} (http://... or tcp://HOST:PORT)")
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=1).close()
        return True
    except OSError:
        return False


@dataclass
class Session:
    """Runs steps in order; holds the servers that run and the port substitutions."""

    tmp: Path
    ports: dict[int, int] = field(default_factory=dict)
    running: dict[Block, Server] = field(default_factory=dict)
    down: dict[Block, str] = field(default_factory=dict)  # servers that did not start: why

    def port(self, doc_port: int) -> int:
        if doc_port not in self.ports:
            self.ports[doc_port] = free_port()
        return self.ports[doc_port]

    def substitute(self, text: str, block: Block) -> str:
        text = PORT_RE.sub(lambda m: str(self.port(int(m.group(1)))), text)
        root = self.tmp / "dirs" / f"{block.name.replace('/', '_')}-s{block.section}"

        def move(m: re.Match) -> str:
            (root / m.group(1).lstrip("/")).mkdir(parents=True, exist_ok=True)
            return str(root) + m.group(1)

        return TMP_RE.sub(move, text)

    def _spawn(self, block: Block, text: str, stdin: str | None):
        work = self.tmp / "blocks"
        work.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^\w.-]", "_", block.id)
        script = work / (stem + (".sh" if block.lang == "bash" else ".py"))
        script.write_text(text)
        log = work / (stem + ".log")
        env = {**os.environ, "ENGINE_TEST_MAX_TOKENS": str(MAX_TOKENS), "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)  # set by tests/conftest.py for the suite, not by users
        if block.lang == "bash" and MAKE_RE.search(text):
            if subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO).returncode != 0:
                raise DocSkip(
                    ".venv is older than pyproject.toml or constraints.txt: make would "
                    "reinstall it first (run make once)"
                )
            env["PORT"] = str(self.port(8000))  # the Makefile's port of make run
        cmd = (
            ["bash", "-e", "-o", "pipefail", str(script)]
            if block.lang == "bash"
            else [sys.executable, str(script)]
        )
        stdin_file = None
        if stdin is not None:
            stdin_file = work / (stem + ".stdin")
            stdin_file.write_text(stdin.replace("\\n", "\n") + "\n")
        with open(log, "wb") as out, open(stdin_file or os.devnull, "rb") as inp:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdin=inp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, log

    # -- steps ------------------------------------------------------------------------------

    def run(self, step: Step) -> None:
        """Run one step; raise DocFailure or DocSkip."""
        if step.skip:
            raise DocSkip(step.skip)
        keep = set(step.servers) | ({step.block} if step.stop else set())
        for block in reversed(list(self.running)):  # a selection that left out a stop step
            if block not in keep:
                self.running.pop(block).tracker.kill_all()
        for server in step.servers:
            if server not in self.running and server not in self.down:
                try:
                    self.start(server)
                except (DocFailure, DocSkip):
                    pass
            if server in self.down:
                raise DocSkip(f"its server {server.id} {self.down[server]}")
        if step.stop:
            if step.block not in self.running:
                raise DocSkip(f"{step.block.id} {self.down.get(step.block, 'did not start')}")
            self.stop(step.block)
        elif step.block.is_server:
            self.start(step.block)
        else:
            self.run_block(step.block)

    def run_block(self, block: Block) -> None:
        text = self.substitute(block.text, block)
        _check_mooncake(text)
        proc, log = self._spawn(block, text, block.markers.get("stdin"))
        tracker = Tracker(proc)
        try:
            rc = proc.wait(BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            tracker.kill_all()
            raise DocFailure(
                f"{block.id} did not finish within {BLOCK_TIMEOUT_S:.0f} s:\n{_tail(log)}"
            ) from None
        tracker.close()
        problems = [f"exited with {rc}"] if rc != 0 else []
        problems += tracker.problems()
        if problems:
            what = "; ".join(problems)
            raise DocFailure(f"{block.id} {what}:\n{text}\n--- output:\n{_tail(log)}")
        print(f"--- {block.id}:\n{text}--- output:\n{_tail(log)}")

    def start(self, block: Block) -> None:
        urls = (block.markers.get("server") or "").split()
        for url in urls:  # the ports it serves: fresh ones
            for m in PORT_RE.finditer(url):
                self.ports[int(m.group(1))] = free_port()
        text = self.substitute(block.text, block)
        urls = [self.substitute(u, block) for u in urls]
        try:
            _check_mooncake(text)
            proc, log = self._spawn(block, text, None)
        except DocSkip as exc:
            self.down[block] = f"is skipped: {exc}"
            raise
        server = Server(block, proc, log, Tracker(proc))
        self.running[block] = server
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(urls)
        while True:
            pending = [u for u in pending if not _ready(u)]
            rc = proc.poll()
            if rc is not None or (pending and time.monotonic() > deadline):
                self.running.pop(block)
                server.tracker.kill_all()
                why = (
                    f"exited with {rc} before it was ready"
                    if rc is not None
                    else f"not ready within {START_TIMEOUT_S:.0f} s ({' '.join(pending)})"
                )
                self.down[block] = f"did not start: {why}"
                raise DocFailure(f"{block.id} {why}:\n{text}\n--- output:\n{_tail(log)}")
            if not pending:
                break
            time.sleep(0.3)
        print(f"--- {block.id} (serving {' '.join(urls) or 'in the background'}):\n{text}")

    def stop(self, block: Block) -> None:
        """SIGTERM to the server (under its shell and make); it must exit 0 and leave no
        process and no /dev/shm file behind."""
        server = self.running.pop(block)
        proc, tracker = server.proc, server.tracker
        problems = []
        rc = proc.poll()
        if rc is not None:
            problems.append(f"exited with {rc} before the end of its section")
        else:
            try:
                _serving_process(proc.pid).send_signal(signal.SIGTERM)
                rc = proc.wait(STOP_TIMEOUT_S)
            except psutil.Error as exc:
                problems.append(f"could not be signalled: {exc}")
                rc = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"still running {STOP_TIMEOUT_S:.0f} s after SIGTERM")
                tracker.kill_all()
            else:
                if rc != 0:
                    problems.append(f"exited with {rc} after SIGTERM")
        tracker.close()
        problems += tracker.problems()
        if problems:
            raise DocFailure(f"{block.id} {'; '.join(problems)}\n--- output:\n{_tail(server.log)}")
        print(f"--- {block.id} stopped (exit 0); output:\n{_tail(server.log)}")

    def close(self) -> None:
        for block in reversed(list(self.running)):
            self.running.pop(block).tracker.kill_all()


def run_markdown(path: Path, tmp: Path, root: Path = REPO) -> list[Result]:
    """Run every step of a Markdown file in order (skip markers and slow steps included:
    a skip marker skips). One Result per step."""
    session = Session(tmp)
    results = []
    try:
        for step in plan_files([path], root):
            try:
                session.run(step)
            except DocSkip as exc:
                results.append(Result(step.id, "skipped", str(exc)))
            except DocFailure as exc:
                results.append(Result(step.id, "failed", str(exc)))
            else:
                results.append(Result(step.id, "passed"))
    finally:
        session.close()
    return results
