"""The SSD tier: a directory of block records, one file per block.

Layout: ``PATH/<namespace id hex>/<key hex>.kvb``, each file a ``block_record`` header followed by
the block. Other namespaces' subdirectories (another model or KV layout) are left alone; a
process takes an exclusive ``flock`` on its namespace directory, so two processes never manage
the same records.

Crash safety: a record is written under a temporary name (``.tmp-...``) and renamed over its real
name (``os.replace``, atomic on POSIX), so a real name never holds half a record; temporaries
left by a crash are deleted at start. ``fsync=False`` (the default) skips the fsync before the
rename: a power loss may then leave a renamed record whose data never reached the disk, which
the checksum turns into a miss on read; ``fsync=True`` makes every stored block durable at the
cost of a disk flush per put.

At start the index is rebuilt from the records' headers (wrong size, magic, version, namespace or
key: the file is removed), oldest file first in the eviction order. Reads verify the whole
record (length and checksum); a bad record is a miss, is removed and is counted. A write that
fails (full disk, I/O error) is a failed write, counted, never an exception.

The files of evicted and removed records are recycled: renamed to a temporary name (a spare) and
overwritten in place by a later put, since creating and unlinking files is what costs most here.
Spares count against the capacity (records + writes in flight + spares <= capacity) and are
deleted at close (or at the next start, after a crash). A reader racing the eviction of the block
it reads may see the file being overwritten: the checksum makes that a plain miss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import uuid
from pathlib import Path

from engine.kvstore import block_record
from engine.kvstore.eviction import make_policy
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.tier import LocalTier, PutResult

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
MAX_SPARES = 64  # files of removed records kept (under temporary names) for reuse


class SsdTier(LocalTier):
    name = "ssd"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        namespace: KVNamespace,
        policy: str = "lru",
        fsync: bool = False,
    ) -> None:
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.record_bytes = block_record.HEADER_SIZE + self.block_bytes
        self.capacity_blocks = capacity_bytes // self.record_bytes
        if self.capacity_blocks < 1:
            raise ValueError(
                f"ssd capacity {capacity_bytes} bytes holds no record of {self.record_bytes} bytes"
            )
        self.fsync = fsync
        self.dir = Path(path) / namespace.id.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise RuntimeError(
                f"ssd tier directory {self.dir} is in use by another process"
            ) from None
        super().__init__("removed_at_start")
        self._policy = make_policy(policy)
        self._index: set[bytes] = set()
        self._writing: dict[bytes, bool] = {}  # key -> cancelled (removed/cleared mid-write)
        self._spares: list[Path] = []  # files of removed records, under temporary names
        self._rebuild()

    # -- the Tier contract -------------------------------------------------------------------------

    def get_into(self, key: bytes, out: memoryview) -> bool:
        out = memoryview(out).cast("B")
        if out.nbytes != self.block_bytes:
            raise ValueError(f"out has {out.nbytes} bytes, a block has {self.block_bytes}")
        with self._lock:
            if key not in self._index:
                self._counters["misses"] += 1
                return False
            self._policy.on_access(key)
        header = bytearray(block_record.HEADER_SIZE)
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                got = _read_full(f.fileno(), [memoryview(header), out])
        except FileNotFoundError:  # evicted since the lookup, or deleted behind our back
            with self._lock:
                self._counters["misses"] += 1
                if key in self._index and not self._path(key).exists():
                    self._index.discard(key)
                    self._policy.on_remove(key)
            return False
        except OSError as e:
            logger.warning("ssd tier: reading %s failed: %s", self._path(key), e)
            return self._bad_record(key)
        parsed = block_record.parse_header(header)
        if (
            size != self.record_bytes
            or got != self.record_bytes
            or parsed is None
            or parsed.namespace != self.namespace.id
            or parsed.key != key
            or parsed.length != self.block_bytes
            or block_record.checksum(out) != parsed.checksum
        ):
            return self._bad_record(key)
        with self._lock:
            self._counters["hits"] += 1
            self._counters["bytes_read"] += self.record_bytes
        return True

    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        data = memoryview(data).cast("B")
        evicted: list[bytes] = []
        with self._lock:
            if data.nbytes != self.block_bytes:
                self._counters["failed_writes"] += 1
                return PutResult(False, evicted)
            if key in self._index or key in self._writing:
                self._policy.on_insert(key, position)
                return PutResult(True, evicted)
            # Invariant: records + writes in flight + spares <= capacity_blocks.
            files = len(self._index) + len(self._writing) + len(self._spares)
            if not self._spares and files >= self.capacity_blocks:
                victim = self._policy.victim()
                if victim is None:  # every file is being written by other threads
                    self._counters["failed_writes"] += 1
                    return PutResult(False, evicted)
                self._remove(victim)  # its file becomes a spare
                self._counters["evictions"] += 1
                evicted.append(victim)
            spare = self._spares.pop() if self._spares else None
            self._writing[key] = False
        ok = self._write_record(key, data, spare)
        with self._lock:
            cancelled = self._writing.pop(key)
            if ok and cancelled:
                self._retire(self._path(key))
            elif ok:
                self._index.add(key)
                self._policy.on_insert(key, position)
                self._counters["bytes_written"] += self.record_bytes
            else:
                self._counters["failed_writes"] += 1
        return PutResult(ok and not cancelled, evicted)

    def remove(self, key: bytes) -> bool:
        with self._lock:
            if key in self._writing:
                self._writing[key] = True
            return self._remove(key)

    def _clearing(self) -> None:
        for key in self._writing:
            self._writing[key] = True  # a write in flight is cancelled

    def _stats(self) -> dict:
        return {"spares": len(self._spares)}

    def close(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            _unlink(spare)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def prefetch(self, keys) -> None:
        """Start reading the records of ``keys`` into the page cache (posix_fadvise WILLNEED),
        without waiting: reading a run of blocks with a window of prefetches ahead keeps the
        disk's queue full (about twice the rate of one read at a time here)."""
        for key in keys:
            if key not in self._index:
                continue
            with contextlib.suppress(OSError), open(self._path(key), "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)

    def drop_page_cache(self, key: bytes) -> None:
        """Ask the kernel to drop the record's cached pages (for benchmarks of cold reads)."""
        with contextlib.suppress(OSError), open(self._path(key), "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    # -- internals ---------------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _write_record(self, key: bytes, data: memoryview, spare: Path | None) -> bool:
        """Write under a temporary name (a spare file, overwritten in place, or a new file),
        then rename it over the record's name."""
        header = block_record.encode_header(self.namespace.id, key, data)
        tmp = spare or self._tmp_name()
        try:
            flags = os.O_WRONLY if spare else os.O_WRONLY | os.O_CREAT | os.O_EXCL
            fd = os.open(tmp, flags, 0o644)
            try:
                _write_full(fd, [header, data])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path(key))
            return True
        except OSError as e:
            level = logging.WARNING if e.errno in (errno.ENOSPC, errno.EDQUOT) else logging.ERROR
            logger.log(level, "ssd tier: writing a record failed: %s", e)
            _unlink(tmp)
            return False

    def _bad_record(self, key: bytes) -> bool:
        with self._lock:
            self._counters["misses"] += 1
            if key not in self._index:  # evicted while we read it (its file was recycled)
                return False
            logger.warning("ssd tier: bad record %s removed", self._path(key).name)
            self._counters["failed_reads"] += 1
            self._index.discard(key)
            self._policy.on_remove(key)
            _unlink(self._path(key))  # never recycled: its size may be wrong
        return False

    def _remove(self, key: bytes) -> bool:
        """Lock held."""
        if key not in self._index:
            return False
        self._index.discard(key)
        self._policy.on_remove(key)
        self._retire(self._path(key))
        return True

    def _retire(self, path: Path) -> None:
        """Lock held. A record that leaves the index becomes a spare (renamed to a temporary
        name, overwritten by a later put) rather than being unlinked: creating and unlinking
        files costs ~1 ms each on ext4 here, a rename ~50 us, which is what makes puts into a
        full tier run near the disk's rate."""
        if len(self._spares) < MAX_SPARES:
            spare = self._tmp_name()
            try:
                os.replace(path, spare)
                self._spares.append(spare)
                return
            except OSError:
                pass
        _unlink(path)

    def _tmp_name(self) -> Path:
        return self.dir / f"{TMP_PREFIX}{uuid.uuid4().hex}"

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes]] = []
        header = bytearray(block_record.HEADER_SIZE)
        for entry in os.scandir(self.dir):
            if entry.name == LOCK_NAME or not entry.is_file(follow_symlinks=False):
                continue
            key = _key_of(entry.name)
            ok = False
            if key is not None:
                try:
                    st = entry.stat()
                    with open(entry.path, "rb", buffering=0) as f:
                        n = f.readinto(header)
                    parsed = block_record.parse_header(header) if n == len(header) else None
                    ok = (
                        st.st_size == self.record_bytes
                        and parsed is not None
                        and parsed.namespace == self.namespace.id
                        and parsed.key == key
                        and parsed.length == self.block_bytes
                    )
                except OSError:
                    ok = False
            if ok:
                found.append((st.st_mtime, key))
            else:  # temporaries from a crash, truncated, foreign or unreadable records
                self._counters["removed_at_start"] += 1
                _unlink(Path(entry.path))
        found.sort()
        excess = max(0, len(found) - self.capacity_blocks)
        for _, key in found[:excess]:  # the capacity shrank since the last run: oldest go
            _unlink(self._path(key))
            self._counters["evictions"] += 1
        for _, key in found[excess:]:
            self._index.add(key)
            self._policy.on_insert(key)
        if self._counters["removed_at_start"]:
            logger.warning(
                "ssd tier: removed %d bad or temporary files from %s",
                self._counters["removed_at_start"],
                self.dir,
            )


def _key_of(name: str) -> bytes | None:
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    try:
        key = bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None
    return key if 0 < len(key) <= block_record.MAX_KEY_LEN else None


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_full(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        if n == 0:
            raise OSError(errno.EIO, "write returned 0")
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _read_full(fd: int, bufs: list[memoryview]) -> int:
    """Fill bufs from fd; returns the bytes read (less only at end of file)."""
    total = 0
    views = list(bufs)
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total
