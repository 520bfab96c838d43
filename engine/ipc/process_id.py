"""Which process a pid names: a decode worker tells when a prefill worker of its host that
could write into its shared staging area is gone for good.

A pid alone is not enough: once a process exits its pid may be given to a new one, so the
process is identified by its pid and its start time (field 22 of /proc/<pid>/stat, clock ticks
since boot), read once while it is known to be alive. A zombie (killed, not yet reaped) counts as
gone: its memory maps are released, so it writes nothing more. Where /proc is missing the check
falls back to ``os.kill(pid, 0)`` (pid reuse is then not detected).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import NamedTuple

logger = logging.getLogger(__name__)


class ProcessId(NamedTuple):
    pid: int
    start_time: int  # clock ticks after boot; -1 where /proc is missing


class _Stat(NamedTuple):
    state: str
    start_time: int


def _stat(pid: int) -> _Stat | None:
    """The process's state and start time; None when there is no such process. Raises OSError
    when /proc cannot be read at all."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        if not os.path.isdir("/proc/self"):
            raise OSError("no /proc") from None
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the
    # last ')'; the fields after it start at field 3 (state), so field 22 is index 19.
    fields = raw[raw.rfind(")") + 2 :].split()
    return _Stat(fields[0], int(fields[19]))


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def identify(pid: int) -> ProcessId | None:
    """The live process with this pid now; None when there is none (exited, or a zombie)."""
    if pid <= 0:
        return None
    try:
        st = _stat(pid)
    except OSError:
        return ProcessId(pid, -1) if _kill0(pid) else None
    if st is None or st.state in ("Z", "X"):
        return None
    return ProcessId(pid, st.start_time)


def is_gone(proc: ProcessId) -> bool:
    """True once the process has exited (or is a zombie, or its pid names another process)."""
    now = identify(proc.pid)
    if now is None:
        return True
    return proc.start_time != -1 and now.start_time != proc.start_time


def remove_orphan_files(prefix: str, directory: str = "/dev/shm") -> list[str]:
    """Unlink the files ``<directory>/<prefix><pid>-...`` whose owning process is gone (our
    shared-memory segments carry their owner's pid: a SIGKILLed owner cannot unlink its own, and
    each may hold gigabytes of the host's shared memory). Returns the names removed."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{glob.escape(prefix)}*")):
        name = os.path.basename(path)
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or identify(int(pid_text)) is not None:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    if removed:
        logger.warning("removed %d segment(s) left by dead processes: %s", len(removed), removed)
    return removed
