"""The network lab (engine/netlab): hosts apart for real, links shaped and cut, and nothing left
behind, also after a SIGKILL. Skips, saying why, where namespaces are refused (not root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine.netlab import NetLab, sweep_stale, unavailable
from engine.netlab.lab import RUN_DIR

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
SERVE = (
    "import socket; s = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen(); print('up', "
    "flush=True); c, _ = s.accept(); print(c.recv(16).decode(), flush=True)"
)


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def connect(lab: NetLab, src: str, dst: str, port: int) -> subprocess.CompletedProcess:
    return lab.run(src, [sys.executable, "-c", CONNECT, lab.addresses[dst], str(port)])


@pytest.fixture
def lab():
    with NetLab(["a", "b", "c"]) as lab:
        yield lab


def test_hosts_have_their_own_hostname_shm_and_address(lab):
    names = {h: lab.run(h, ["hostname"]).stdout.strip() for h in lab.hosts}
    assert len(set(names.values())) == 3 and os.uname().nodename not in names.values()
    assert lab.run("b", ["touch", "/dev/shm/only-on-b"]).returncode == 0
    assert lab.run("b", ["ls", "/dev/shm"]).stdout.split() == ["only-on-b"]
    assert lab.run("c", ["ls", "/dev/shm"]).stdout.split() == []
    assert not os.path.exists("/dev/shm/only-on-b")
    assert "10.213.0.2/24" in lab.run("b", ["ip", "-br", "addr", "show", "eth0"]).stdout


def test_tcp_between_hosts_and_a_partition(lab):
    server = lab.popen("c", [sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "up"
    send = "import socket; socket.create_connection(('10.213.0.3', 9000)).sendall(b'hello')"
    assert lab.run("a", [sys.executable, "-c", send]).returncode == 0
    assert server.stdout.readline().strip() == "hello"
    lab.link_down("c")  # c is alive but unreachable: a connect times out, nothing refuses it
    cut = connect(lab, "a", "c", 9001)
    assert cut.returncode != 0 and "timed out" in cut.stderr
    assert connect(lab, "a", "b", 9001).stderr.strip().endswith("Connection refused")
    lab.link_up("c")  # reachable again: the closed port answers with a refusal
    assert connect(lab, "a", "c", 9001).stderr.strip().endswith("Connection refused")


def test_a_silent_cut_keeps_the_carrier(lab):
    """cut: c unreachable while its eth0 keeps its carrier (LOWER_UP); mend: reachable again."""
    lab.cut("c")
    cut = connect(lab, "a", "c", 9001)
    assert cut.returncode != 0 and "timed out" in cut.stderr
    assert "LOWER_UP" in lab.run("c", ["ip", "link", "show", "eth0"]).stdout
    lab.mend("c")  # a's failed ARP entry for c may answer "No route to host" for a moment
    deadline = time.monotonic() + 10
    while not connect(lab, "a", "c", 9001).stderr.strip().endswith("Connection refused"):
        assert time.monotonic() < deadline, "c unreachable 10 s after mend"
        time.sleep(0.2)


def test_shape_limits_both_ends_and_unshape(lab):
    lab.shape("b", "100mbit")
    shown = lab.qdisc("b")
    assert shown.count("tbf") == 2 and shown.count("rate 100Mbit") == 2
    assert shown.count("lat 50ms") == 2  # a shallow switch buffer by default
    lab.shape("b", "100mbit", queue_ms=800)  # a deep one
    assert lab.qdisc("b").count("lat 800ms") == 2
    lab.shape("b", None)
    assert "tbf" not in lab.qdisc("b")
    with pytest.raises(ValueError, match="rate '1 gigabit'"):
        lab.shape("b", "1 gigabit")
    with pytest.raises(ValueError, match="queue_ms must be in"):
        lab.shape("b", "1gbit", queue_ms=0)


def test_bad_host_names_are_refused():
    with pytest.raises(ValueError, match="host name 'Router-1'"):
        NetLab(["Router-1"])
    with pytest.raises(ValueError, match="names repeat"):
        NetLab(["a", "a"])


def test_close_kills_processes_and_removes_everything():
    lab = NetLab(["a", "b"])
    sleeper = lab.popen("a", ["sleep", "600"])
    prefix = lab.prefix
    assert sum(n.startswith(prefix) for n in netns_names()) == 3  # two hosts and the switch
    lab.close()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not [n for n in netns_names() if n.startswith(prefix)]
    assert not os.path.exists(lab.run_dir)
    lab.close()  # idempotent


def test_a_killed_labs_leftovers_are_swept():
    code = (
        "import os, signal, subprocess; from engine.netlab import NetLab; "
        "lab = NetLab(['x', 'y']); "
        "lab.popen('x', ['sleep', '600'], stdout=subprocess.DEVNULL, "
        "stderr=subprocess.DEVNULL); print(lab.prefix, "
        "flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    prefix = proc.stdout.strip()
    assert sum(n.startswith(prefix) for n in netns_names()) == 3  # left behind by the kill
    gone = sweep_stale()
    assert sum(n.startswith(prefix) for n in gone) == 3
    assert not [n for n in netns_names() if n.startswith(prefix)]
    pid = prefix[3:].split("-")[0]
    deadline = time.monotonic() + 5
    while os.path.exists(os.path.join(RUN_DIR, f"enl{pid}")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(os.path.join(RUN_DIR, f"enl{pid}"))


def _bind_in(netns: str, address: str, conn) -> None:
    import socket
    import threading

    from engine.netlab import enter

    enter(netns)
    out = []

    def bind() -> None:  # a thread started after enter(): on the host too
        s = socket.socket()
        s.bind((address, 0))
        out.append(s.getsockname()[1])
        s.close()

    th = threading.Thread(target=bind)
    th.start()
    th.join()
    conn.send(out)


def test_enter_puts_a_process_and_its_new_threads_on_a_host(lab):
    import multiprocessing as mp
    import socket

    with pytest.raises(OSError):  # not an address of this machine's own network
        socket.socket().bind((lab.addresses["b"], 0))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_bind_in, args=(lab.netns("b"), lab.addresses["b"], there))
    proc.start()
    assert here.poll(60), "the process on b did not answer"
    assert len(here.recv()) == 1
    proc.join(10)
    assert proc.exitcode == 0
