"""The public names the docs promise stay where they are documented, whatever the layout behind
them: ``from engine import LLM, AsyncLLM, SamplingParams, StructuredOutputs``,
``engine.sampling_params``, the outputs, ``engine.client.RPCClient``, and the ``engine`` command's
entry point (with the old ``engine.server.cli:main`` kept for scripts that name it)."""

import subprocess
import sys
from pathlib import Path

import engine
import engine.client
import engine.sampling_params
import engine.structured
from engine.cli.main import main
from engine.outputs import CompletionOutput, RequestOutput
from engine.server import rpc_client


def test_the_package_exports_the_embedded_api():
    from engine.async_llm import AsyncLLM
    from engine.llm import LLM

    assert engine.LLM is LLM and engine.AsyncLLM is AsyncLLM
    assert engine.SamplingParams is engine.sampling_params.SamplingParams
    assert engine.StructuredOutputs is engine.structured.StructuredOutputs
    assert RequestOutput.__module__ == "engine.outputs" == CompletionOutput.__module__


def test_engine_client_names_the_rpc_clients():
    for name in ("RPCClient", "AsyncRPCClient", "RPCError", "RPCTimeoutError", "DEFAULT_ADDRESS"):
        assert getattr(engine.client, name) is getattr(rpc_client, name), name


def test_the_engine_command_and_its_old_entry_point():
    from engine.server.cli import main as old_main

    assert old_main is main
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '\n[project.scripts]\nengine = "engine.cli.main:main"\n' in pyproject
    out = subprocess.run(
        [sys.executable, "-m", "engine", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for command in ("generate", "chat", "serve", "rpc", "worker", "router", "cluster", "pool"):
        assert command in out.stdout
