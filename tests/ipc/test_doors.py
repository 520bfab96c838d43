"""Closed doors that need no peer: every listener's default is loopback, the shared-memory names
processes pass each other are checked before anything is mapped, and no code path can unpickle
or evaluate bytes (checked on the source, so a new ``pickle.loads`` fails here first)."""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path

import pytest

from engine.ipc import curve
from engine.ipc.shm_names import (
    POOL_PREFIX,
    STAGING_PREFIX,
    check_shm_name,
    check_shm_path,
)

REPO = Path(__file__).resolve().parents[2]
LISTEN_OPTIONS = ("--host", "--address", "--kv-host", "--rpc-address")


def _parser() -> argparse.ArgumentParser:
    """The command line's parser, as ``engine`` builds it."""
    from engine.cli import main as cli

    captured = {}

    class Captured(Exception):
        pass

    def grab(self, *a, **k):
        captured["parser"] = self
        raise Captured

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        with pytest.raises(Captured):
            cli.main([])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return captured["parser"]


def _walk(parser: argparse.ArgumentParser, path: str = "engine"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_listener_defaults_to_loopback():
    seen = []
    for command, action in _walk(_parser()):
        for opt in action.option_strings:
            if opt in LISTEN_OPTIONS:
                seen.append(f"{command} {opt}")
                default = action.default
                if default is None:
                    continue  # not bound unless given
                address = default if "://" in str(default) else f"tcp://{default}:0"
                assert curve.is_loopback(address), f"{command} {opt} defaults to {default!r}"
    assert {"engine serve --host", "engine cluster --host", "engine pool serve --host",
            "engine worker --kv-host", "engine router --address"} <= set(seen)  # fmt: skip
    from engine.client import DEFAULT_ADDRESS
    from engine.cluster.router.router import RouterConfig
    from engine.kvstore.service.server import PoolServiceConfig

    assert curve.is_loopback(DEFAULT_ADDRESS)
    assert curve.is_loopback(RouterConfig().address)
    assert PoolServiceConfig(port=0, dram_bytes=1).host == "127.0.0.1"


@pytest.mark.parametrize(
    "name",
    [
        "../engine-kvstage-1",
        "engine-kvstage-../../etc/passwd",
        "engine-kvstage-a/b",
        "engine-kvstage-..",
        "/dev/shm/engine-kvstage-1",
        "other-1",
        "engine-kvstage-" + "x" * 300,
        "engine-kvstage-\x00",
        "engine-kvstage-é",
        "",
    ],
)
def test_bad_shm_names_are_refused(name):
    with pytest.raises(ValueError, match="shared-memory name"):
        check_shm_name(name, STAGING_PREFIX)


def test_good_shm_names_pass():
    assert check_shm_name("engine-kvstage-123-abcd1234", STAGING_PREFIX)
    assert check_shm_name("engine-kv-nonce-0123abcd", POOL_PREFIX)
    assert check_shm_path("/dev/shm/engine-kvstage-9-ff", STAGING_PREFIX)
    for bad in ("/dev/shm/../tmp/engine-kvstage-1", "/tmp/engine-kvstage-1", 7):
        with pytest.raises(ValueError):
            check_shm_path(bad, STAGING_PREFIX)


def test_a_prefill_worker_maps_only_staging_arenas(tmp_path):
    """The path comes in a router message: a crafted one is refused before any open()."""
    from engine.cluster.transfer.staging import PeerArenas

    victim = tmp_path / "engine-kvstage-victim"
    victim.write_bytes(b"x" * 4096)
    rel = os.path.relpath(victim, "/dev/shm")
    peers = PeerArenas()
    for path in (f"/dev/shm/{rel}", str(victim), "/dev/shm/engine-kvstage-1/../../etc/passwd"):
        with pytest.raises(ValueError):
            peers.get(path)
    assert victim.read_bytes() == b"x" * 4096


def test_a_pool_client_maps_only_pool_segments(tmp_path):
    """Names in a pool service's hello_ok: a crafted one means no mapping (TCP), not a file."""
    from engine.kvstore.service import protocol as P
    from engine.kvstore.service.connection import _map_arena

    victim = tmp_path / "engine-kv-victim"
    victim.write_bytes(b"n" * 1024)
    rel = os.path.relpath(victim, "/dev/shm")
    nonce = f"engine-kv-testnonce-{os.getpid()}"
    with open(f"/dev/shm/{nonce}", "wb") as f:  # a genuine same-host proof
        f.write(b"n")
    try:
        ok = P.HelloOk(shm_name=nonce, arena_bytes=1, nonce_shm=nonce, nonce=b"n")
        assert _map_arena(ok) is not None  # the check lets our own names through
        cases = ((rel, nonce), (str(victim), nonce), ("engine-kv-a", rel), (nonce, str(victim)))
        for shm_name, nonce_shm in cases:
            hello = P.HelloOk(shm_name=shm_name, arena_bytes=1024, nonce_shm=nonce_shm, nonce=b"n")
            assert _map_arena(hello) is None, (shm_name, nonce_shm)
    finally:
        os.unlink(f"/dev/shm/{nonce}")


# -- nothing from a socket is unpickled or evaluated -----------------------------------------

BANNED_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def _sources():
    for root in ("engine", "profiling"):
        yield from sorted((REPO / root).rglob("*.py"))


def test_no_code_can_unpickle_or_evaluate():
    problems = []
    files = list(_sources())
    assert len(files) > 50
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(REPO)
        where = lambda node, rel=rel: f"{rel}:{node.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in BANNED_MODULES:
                        problems.append(f"{where(node)} imports {alias.name}")
            elif isinstance(node, ast.ImportFrom):
                if (node.module or "").split(".")[0] in BANNED_MODULES:
                    problems.append(f"{where(node)} imports from {node.module}")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                    problems.append(f"{where(node)} calls {f.id}()")
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                kwargs = {k.arg: k.value for k in node.keywords}
                if name == "load" and isinstance(f, ast.Attribute):
                    base = getattr(f.value, "id", "")
                    wo = kwargs.get("weights_only")
                    if base == "torch" and not (isinstance(wo, ast.Constant) and wo.value is True):
                        problems.append(f"{where(node)} torch.load without weights_only=True")
                    ap = kwargs.get("allow_pickle")
                    if base in ("np", "numpy") and isinstance(ap, ast.Constant) and ap.value:
                        problems.append(f"{where(node)} np.load(allow_pickle=True)")
                if name in ("unpackb", "Unpacker") and "ext_hook" in kwargs:
                    problems.append(f"{where(node)} msgpack with an ext_hook (objects from bytes)")
                if name in ("recv_pyobj", "recv_serialized", "loads") and isinstance(
                    f, ast.Attribute
                ):
                    base = getattr(f.value, "id", "")
                    if name != "loads" or base not in ("json", "orjson", "tomllib", "msgpack"):
                        problems.append(f"{where(node)} calls {base}.{name}")
    assert not problems, "\n".join(problems)


def test_write_doors_record():
    from reliab_record import record_if_the_run_passes

    record_if_the_run_passes(
        "doors",
        "closed-doors",
        "CURVE forced over loopback on the router, the RPC server and a pool service process "
        "(clients: ours, one without CURVE, one with an unknown key pair); binding beyond "
        "loopback without keys; listener defaults over the whole command line; 10 crafted "
        "shared-memory names and paths; an AST scan of engine/ and profiling/ for pickle, "
        "marshal, eval/exec, torch.load without weights_only",
        {"checks": 5},
        "only our key pair got replies or registered; unauthenticated peers got nothing; "
        "beyond-loopback bind refused without keys; every default listener on loopback; "
        "crafted names refused before any open(); no unpickling or eval in the source",
    )
