"""What the network lab's cluster tests share: the workers' small memory options, the
environment the hosts' processes get, log tails, and a comparison of an HTTP completion choice
with the one expected (colocated serving, or the cluster's own before a fault)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from doc_hosts import REPO

WORKER_EXTRA = [
    *("--model", "default", "--dtype", "float32", "--max-model-len", "512"),
    *("--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "64", "--threads", "1"),
]


def env(**extra: str) -> dict[str, str]:
    """This process's environment for a host's process: one torch thread, the repository on
    the path, no CURVE keys but what a command line names; ``extra`` on top."""
    out = dict(os.environ, OMP_NUM_THREADS="1")
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    out.pop("ENGINE_CURVE_KEYS", None)  # the documented --curve-keys only
    out.update(extra)
    return out


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_bytes()[-chars:].decode(errors="replace")


def tails(procs, chars: int = 1500) -> str:
    """The tails of ``(name, proc, log)``'s logs, for a failure's message."""
    return "\n".join(f"--- {name}:\n{tail(log, chars)}" for name, _, log in procs)


def assert_equal(got: dict, want: dict) -> None:
    """An HTTP completion choice (``logprobs`` 3) equals ``want``: token strings, text,
    logprobs and top logprobs, exactly."""
    lp = got["logprobs"]
    assert lp["tokens"] == want["tokens"]
    assert got["text"] == want["text"]
    assert lp["token_logprobs"] == want["values"]
    for top, wtop in zip(lp["top_logprobs"], want["tops"]):
        assert top.keys() == wtop.keys()
        assert list(top.values()) == [wtop[k] for k in top]


def stop_all(procs, timeout_s: float, may_die_by_signal: tuple[str, ...] = ()) -> None:
    """SIGTERM each (name, process, log) in reverse order of start; each must exit 0 within
    ``timeout_s`` (those named in ``may_die_by_signal`` have no handler: any code)."""
    for name, proc, log in reversed(procs):
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{name} did not stop in {timeout_s:g} s\n{tail(log)}") from None
        if name not in may_die_by_signal:
            assert rc == 0, f"{name} exited {rc}\n{tail(log)}"
