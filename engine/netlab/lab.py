"""Hosts apart on one machine: network, UTS and mount namespaces joined by one switch, with links
that can be shaped and cut. For tests and benchmarks of the cluster between hosts; needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN); ``unavailable()`` says why not, for a skip.

    with NetLab(["a", "b", "c"]) as lab:           # 10.213.0.1, .2, .3
        lab.shape("c", "1gbit")                    # tbf at both ends of c's link
        proc = lab.popen("b", ["engine", "worker", ...])
        lab.link_down("c"); ...; lab.link_up("c")  # a partition: c alive, unreachable
        lab.cut("c"); ...; lab.mend("c")            # the same, c's carrier kept (switch drops)

Layout: a switch namespace holds a bridge; each host has its own network namespace with ``lo``
and ``eth0`` (a veth whose other end is on the bridge), its own hostname (a UTS namespace), and
its own mount namespace with a private tmpfs on /dev/shm, so that shared memory between two hosts
is impossible, as between real machines. The UTS and mount namespaces are kept by bind mounts
under RUN_DIR, so every command run on a host (``nsenter``) joins the same ones.

Everything is named with a per-run prefix ``enl<pid>-``: ``close()`` (also at exit, and on
``__exit__`` when a test fails) kills what runs in the namespaces and removes them, and every
new lab first sweeps what labs of dead processes left (a SIGKILLed test), as the shared-memory
sweeps do. Traffic stays inside: the switch has no link to the machine's own network.
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from engine.ipc.process_id import identify

RUN_DIR = "/run/engine-netlab"
PREFIX = "enl"
SUBNET = "10.213.0.0/24"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
CLONE_NEWNET = 0x40000000


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable() -> str | None:
    """Why no lab can be made here (not root, no ip/tc/nsenter, namespaces refused); None if one
    can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc", "bridge", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add refused: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def enter(netns: str) -> None:
    """Move the calling thread into the network namespace ``netns`` (``NetLab.netns(host)``):
    the sockets it opens from then on, and the threads it starts (ZeroMQ's, a KVSender's), are
    that host's. For a Python process started by this one (multiprocessing) that should run on
    a lab host, called first thing; it keeps its mount namespace (the machine's /dev/shm), so
    use ``popen`` where a host's own /dev/shm matters."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped by its parent) counts as gone."""
    return identify(pid) is not None


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove the namespaces and bind mounts of labs whose process is gone; their names."""
    gone = []
    for name in _netns_names():
        m = re.match(rf"^{PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_netns(name)
            gone.append(name)
    if os.path.isdir(RUN_DIR):
        for entry in os.listdir(RUN_DIR):
            m = re.match(rf"^{PREFIX}(\d+)$", entry)
            if m and not _pid_alive(int(m.group(1))):
                _remove_run_dir(os.path.join(RUN_DIR, entry))
                gone.append(entry)
    return gone


def _kill_netns_procs(name: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not _run("ip", "netns", "pids", name, check=False).stdout.split():
                return
            time.sleep(0.05)


def _remove_netns(name: str) -> None:
    _kill_netns_procs(name)
    _run("ip", "netns", "del", name, check=False)


def _remove_run_dir(path: str) -> None:
    for entry in sorted(os.listdir(path)):
        _run("umount", "-l", os.path.join(path, entry), check=False)
    shutil.rmtree(path, ignore_errors=True)


class NetLab:
    """Named hosts on one switch (see the module docstring). ``hosts``: short lower-case names
    (letters and digits, up to 8), given addresses in SUBNET in order."""

    def __init__(self, hosts: Sequence[str], shm_size: str = "2g") -> None:
        if not hosts:
            raise ValueError("hosts: give at least one host name")
        for h in hosts:
            if not _NAME.match(h):
                raise ValueError(f"host name {h!r}: lower-case letters and digits, 1 to 8")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: names repeat in {list(hosts)}")
        reason = unavailable()
        if reason:
            raise RuntimeError(f"no network lab here: {reason}")
        sweep_stale()
        self.prefix = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.run_dir = os.path.join(RUN_DIR, f"{PREFIX}{os.getpid()}")
        self.hosts = list(hosts)
        net = ipaddress.ip_network(SUBNET)
        self.addresses = {h: str(net.network_address + i + 1) for i, h in enumerate(hosts)}
        self.rates: dict[str, str | None] = dict.fromkeys(hosts)
        self._closed = False
        self._procs: list[subprocess.Popen] = []
        atexit.register(self.close)
        try:
            self._build(shm_size)
        except BaseException:
            self.close()
            raise

    # names
    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def _port(self, host: str) -> str:  # the switch side of host's link (15 chars at most)
        return f"p{self.hosts.index(host)}{self.prefix[-4:]}"

    def _ns_file(self, host: str, kind: str) -> str:
        return os.path.join(self.run_dir, f"{self.prefix[-4:]}-{host}.{kind}")

    def _build(self, shm_size: str) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        _run("ip", "netns", "add", self.switch)
        sw = ("ip", "-n", self.switch)
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.netns(host)
            _run("ip", "netns", "add", ns)
            tmp = f"t{i}{self.prefix[-4:]}"
            # Made in the switch namespace, so no name is ever taken in the machine's own.
            _run(*sw, "link", "add", self._port(host), "type", "veth", "peer", "name", tmp)
            _run(*sw, "link", "set", tmp, "netns", ns)
            _run("ip", "-n", ns, "link", "set", tmp, "name", "eth0")
            _run(*sw, "link", "set", self._port(host), "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            uts, mnt = self._ns_file(host, "uts"), self._ns_file(host, "mnt")
            for f in (uts, mnt):
                open(f, "w").close()
            script = (
                f"hostname {self.prefix}-{host} && "
                f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm"
            )
            _run(
                "unshare", f"--uts={uts}", f"--mount={mnt}", "--propagation", "private",
                "sh", "-c", script,
            )  # fmt: skip

    # running things on a host
    def command(self, host: str, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """argv, run inside ``host``'s network, UTS and mount namespaces, in ``cwd`` (default:
        this process's working directory; entering a mount namespace would otherwise start at
        /)."""
        if host not in self.addresses:
            raise ValueError(f"host {host!r}: the lab's hosts are {self.hosts}")
        return [
            "nsenter", f"--net=/run/netns/{self.netns(host)}",
            f"--uts={self._ns_file(host, 'uts')}", f"--mount={self._ns_file(host, 'mnt')}",
            f"--wd={os.path.abspath(cwd or os.getcwd())}", "--", *argv,
        ]  # fmt: skip

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start argv on ``host`` (subprocess.Popen's keywords); killed by close() if still
        running."""
        proc = subprocess.Popen(self.command(host, argv, kwargs.get("cwd")), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0, **kwargs):
        """Run argv on ``host`` to the end (subprocess.run's keywords; text output captured)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        cmd = self.command(host, argv, kwargs.get("cwd"))
        return subprocess.run(cmd, timeout=timeout, **kwargs)

    # links
    def shape(self, host: str, rate: str | None, queue_ms: int = 50) -> None:
        """Limit ``host``'s link to ``rate`` (tc units: "100mbit", "1gbit", "4gbit") in both
        directions: tbf on eth0 (what the host sends) and on its switch port (what it receives),
        each queueing up to ``queue_ms`` of traffic (a switch port's buffer; more than that is
        dropped). None removes the limit."""
        if not 1 <= queue_ms <= 10_000:
            raise ValueError(f"queue_ms must be in [1, 10000], got {queue_ms}")
        bps = None if rate is None else _rate_bits(rate)
        self.rates[host] = rate
        for ns, dev in ((self.netns(host), "eth0"), (self.switch, self._port(host))):
            if rate is None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                     check=False)  # fmt: skip
                continue
            # burst: at least one tick's worth at HZ 250 (else tbf cannot reach the rate), and
            # a 64 KiB GSO packet; the queue holds queue_ms of traffic.
            burst = max((bps or 0) // 8 // 250, 65536 + 1514)
            _run(
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", str(burst), "latency", f"{queue_ms}ms",
            )  # fmt: skip

    def link_down(self, host: str) -> None:
        """Cut ``host`` from every other host (its switch port down): the host and what runs
        there stay alive, with their sockets open, as across a failed link or switch."""
        _run("ip", "-n", self.switch, "link", "set", self._port(host), "down")

    def link_up(self, host: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(host), "up")

    def cut(self, host: str) -> None:
        """Cut ``host`` off at the switch, silently: its port stops forwarding (bridge port
        state disabled) while both ends of its link keep their carrier, so nothing on the host
        learns of it, as when a switch or a link beyond the host's own fails. (``link_down``
        takes the carrier away too: the host's TCP then sees its sends fail and retries every
        half second rather than with its backoff.)"""
        _run("bridge", "-n", self.switch, "link", "set", "dev", self._port(host), "state", "0")

    def mend(self, host: str) -> None:
        """Undo ``cut``: the port forwards again."""
        _run("bridge", "-n", self.switch, "link", "set", "dev", self._port(host), "state", "3")

    def qdisc(self, host: str) -> str:
        """``tc qdisc show`` of both ends of ``host``'s link (what shape() set)."""
        own = _run("ip", "netns", "exec", self.netns(host), "tc", "qdisc", "show", "dev", "eth0")
        port = _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "show", "dev",
                    self._port(host))  # fmt: skip
        return own.stdout + port.stdout

    # teardown
    def close(self) -> None:
        """Kill what runs on the hosts, remove namespaces and mounts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in [n for n in _netns_names() if n.startswith(self.prefix)]:
            _remove_netns(name)
        if os.path.isdir(self.run_dir):
            for entry in os.listdir(self.run_dir):
                if entry.startswith(self.prefix[-4:]):
                    _run("umount", "-l", os.path.join(self.run_dir, entry), check=False)
                    os.unlink(os.path.join(self.run_dir, entry))
            if not os.listdir(self.run_dir):
                os.rmdir(self.run_dir)
        atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def _rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: a number and bit, kbit, mbit or gbit, e.g. 1gbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])
