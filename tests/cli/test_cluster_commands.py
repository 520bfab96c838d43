"""``engine cluster`` hands its engine and worker options to every worker: each option, set to a
value other than its default, gives the worker the configuration the cluster's own command line
gives (a round trip over every option ``engine cluster --help`` lists), and an option left at
its default is not written out at all, so a default can never reach a worker as the string
"None" (which made the README's ``engine cluster`` command fail to start)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from engine.cli.cluster import (
    _router_config,
    _worker_options,
    add_cluster_commands,
    worker_argv,
)
from engine.cli.engine_options import add_engine_options, engine_config_from_args
from engine.cluster.router.config import RouterConfig

BASE = ["cluster", "--prefill", "1", "--decode", "1"]
# Option values that must be well-formed (the rest are derived from the option's type).
VALUES = {
    "--kv-pool": "dram=64MiB",
    "--model": "/models/other.gguf",
    "--device": "cpu",
    "--block-size": "32",
    "--gpu-memory-utilization": "0.45",  # in (0, 1]
    "--prompt-lookup-min": "3",  # <= --prompt-lookup-max
    "--rope-scaling": '{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 8}',
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cluster_commands(p.add_subparsers(dest="command"), add_engine_options)
    return p


def option_actions(add_options) -> list[argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    add_options(p)
    return [a for a in p._actions if a.option_strings]


def other_value(action: argparse.Action) -> list[str]:
    """Command-line words that set ``action`` to something other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [f"--no-{flag[2:]}" if action.default else flag]
    if action.nargs == 0:  # store_true
        return [flag]
    if flag in VALUES:
        return [flag, VALUES[flag]]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if action.type is int:
        return [flag, str((action.default or 0) + 3)]
    if action.type is float:
        return [flag, str((action.default or 0) + 0.75)]
    return [flag, "other-value"]


def worker_of(cluster_args: argparse.Namespace) -> argparse.Namespace:
    words = [
        "worker",
        "--role",
        "decode",
        "--router",
        "tcp://127.0.0.1:1",
        *worker_argv(cluster_args),
    ]
    return parser().parse_args(words)


CLUSTER_OPTIONS = option_actions(add_engine_options) + [
    a for a in option_actions(_worker_options) if a.dest not in ("kv_transport", "threads")
]


@pytest.mark.parametrize("action", CLUSTER_OPTIONS, ids=lambda a: a.option_strings[0])
def test_each_option_reaches_the_worker(action):
    args = parser().parse_args(BASE + other_value(action))
    assert getattr(args, action.dest) != action.default
    worker = worker_of(args)
    assert getattr(worker, action.dest) == getattr(args, action.dest)
    assert engine_config_from_args(worker) == engine_config_from_args(args)


def test_defaults_are_not_written_out():
    args = parser().parse_args(BASE)
    argv = worker_argv(args)
    assert "None" not in argv
    assert argv == ["--kv-staging-mb", "1024", "--log-level", "info"]
    assert engine_config_from_args(worker_of(args)) == engine_config_from_args(args)


def test_every_engine_option_is_an_option_of_cluster_and_worker():
    """A new engine option is taken by ``engine cluster`` and ``engine worker`` alike."""
    sub = parser()._subparsers._group_actions[0].choices
    for action in option_actions(add_engine_options):
        for command in ("cluster", "worker"):
            assert action.option_strings[0] in sub[command]._option_string_actions, command


@pytest.mark.parametrize("command", ["cluster", "router"])
def test_max_pending_reaches_the_router(command):
    """``--max-pending`` bounds the requests the router holds (it was accepted and ignored)."""
    words = BASE if command == "cluster" else ["router"]
    args = parser().parse_args([*words, "--max-pending", "7"])
    assert _router_config(args, "tcp://127.0.0.1:0").max_pending == 7
    default = _router_config(parser().parse_args(words), "tcp://127.0.0.1:0")
    assert default.max_pending == 4096
    with pytest.raises(ValueError, match="--max-pending must be >= 1"):
        _router_config(parser().parse_args([*words, "--max-pending", "0"]), "tcp://127.0.0.1:0")


@pytest.mark.parametrize("command", ["cluster", "router"])
def test_transfer_deadline_reaches_the_router(command):
    """``--transfer-deadline`` sets how long decode workers wait for KV (default: the config's)."""
    words = BASE if command == "cluster" else ["router"]
    args = parser().parse_args([*words, "--transfer-deadline", "7.5"])
    assert _router_config(args, "tcp://127.0.0.1:0").transfer_deadline_s == 7.5
    default = _router_config(parser().parse_args(words), "tcp://127.0.0.1:0")
    assert default.transfer_deadline_s == RouterConfig().transfer_deadline_s


def test_each_engine_flag_default_is_its_config_fields_default():
    """ENGINE_FLAGS is the one map of engine flags to EngineConfig fields: each flag's default
    is the field's own, so the command line and the embedded API start the same engine."""
    from engine.cli.engine_options import ENGINE_FLAGS
    from engine.config import EngineConfig

    config = EngineConfig()
    for f in ENGINE_FLAGS:
        value = config
        for part in f.field.split("."):
            value = getattr(value, part)
        assert f.default == value, f.flag
    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--no-prefix-caching", "--block-size", "32", "--max-num-seqs", "7"])
    assert engine_config_from_args(args) == replace(
        config,
        cache=replace(config.cache, enable_prefix_caching=False, block_size=32),
        scheduler=replace(config.scheduler, max_num_seqs=7),
        show_progress=True,
    )


@pytest.mark.parametrize("command", [BASE, ["router", "--address", "tcp://127.0.0.1:1"]])
def test_tool_call_parser_reaches_the_http_server(command, monkeypatch):
    """``--tool-call-parser`` of ``engine cluster`` and ``engine router`` is the HTTP server's,
    as it is ``engine serve``'s (left out, the server reads the format from the template)."""
    import engine.server.uvicorn_server as uvicorn_server
    from engine.cli.cluster import _serve

    seen = {}
    monkeypatch.setattr(uvicorn_server, "serve_http", lambda router, **kw: seen.update(kw) or 0)
    for extra, want in (([], None), (["--tool-call-parser", "hermes"], "hermes")):
        assert _serve(object(), parser().parse_args(command + extra)) == 0
        assert seen["tool_call_parser"] == want


def test_stage_options_are_checked_before_anything_starts(capsys):
    """``engine worker --stage`` and ``engine cluster --prefill-groups`` refuse bad values with
    the option named, before a model loads or a process starts."""
    from engine.cli.main import main

    worker = ["worker", "--role", "prefill", "--router", "tcp://127.0.0.1:1"]
    assert main([*worker, "--group", "g", "--stage", "2"]) == 2
    assert "--stage: a stage is written I/N" in capsys.readouterr().err
    for extra, words in (
        (["--stage", "0/2"], "needs both --group NAME and --stage I/N"),
        (["--group", "g"], "needs both --group NAME and --stage I/N"),
        (["--group", "g", "--stage", "0/2", "--kv-pool", "dram=64MiB"], "without a KV pool"),
        (["--group", "g", "--stage", "1/2", "--role", "decode"], "only prefill workers form"),
    ):
        assert main([*worker, *extra]) == 2
        assert words in capsys.readouterr().err
    assert main(["cluster", "--prefill", "0", "--decode", "1"]) == 2
    assert "--prefill >= 1 or --prefill-groups >= 1" in capsys.readouterr().err
    assert main(["cluster", "--prefill-groups", "1", "--stages", "1"]) == 2
    assert "--stages must be in [2, 64], got 1" in capsys.readouterr().err
