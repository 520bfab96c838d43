"""The rules of docs/architecture.md ("Which way imports point", "The layout"), checked on the
code so that the next feature cannot undo them:

- every import of ``engine/`` points down or sideways, layer by layer (``LAYERS`` below, the
  table docs/architecture.md draws), counted as ``tests/test_import_graph.py`` counts them: at
  module level and inside functions alike;
- no file of ``engine/`` (Python or C) is over 500 lines.
"""

from __future__ import annotations

from pathlib import Path

from test_import_graph import ROOT, import_graph

# Lowest first. A module belongs to the layer of the longest prefix that names it; it may import
# its own layer and those below it, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "plain values: configs, parameters, outputs, errors, environment, the CPU",
        (
            "engine.envs",
            "engine.cpu_isa",
            "engine.config",
            "engine.pipeline_stage",
            "engine.pool_spec",
            "engine.speculative_config",
            "engine.errors",
            "engine.outputs",
            "engine.sampling_params",
            "engine.structured.params",
        ),
    ),
    ("codec and names, kernels", ("engine.ipc", "engine.kernels")),
    ("layers", ("engine.layers",)),
    ("model", ("engine.model",)),
    ("where KV lives; grammars", ("engine.kvcache", "engine.kvstore", "engine.structured")),
    # The seam speaks the core's request types (and a request holds its detokenizer); they
    # import nothing above themselves. Speculative decoding's parts (proposers, draft budgets,
    # the accept rule) work on those requests too, and the core's step calls them.
    (
        "the KV-connector seam; speculative decoding",
        (
            "engine.kv_connector",
            "engine.core.request",
            "engine.core.scheduler_output",
            "engine.core.detokenizer",
            "engine.spec",
        ),
    ),
    ("public API and core", ("engine", "engine.llm", "engine.async_llm", "engine.core")),
    ("cluster: router, conductor, workers, the P/D transport", ("engine.cluster",)),
    (
        "entry points and tools",
        (
            "engine.__main__",
            "engine.cli",
            "engine.client",
            "engine.server",
            "engine.server.responses",
            "engine.server.dashboard",
            "engine.netlab",
            "engine.sim",
            "engine.bench",
        ),
    ),
)

MAX_LINES = 500
SOURCE_SUFFIXES = (".py", ".c", ".h")


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming ``module``."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_layering.py LAYERS: add it")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if there > here:
                out.append(f"{module} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
    return out


def test_every_module_has_a_layer():
    graph = import_graph(ROOT, "engine")
    assert len(graph) > 50
    for module in graph:
        layer_of(module)  # KeyError naming a module no layer covers


def test_imports_point_down_layer_by_layer():
    wrong = upward_imports(import_graph(ROOT, "engine"))
    assert not wrong, "upward imports in engine/:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "engine"
    for rel, text in {
        "__init__.py": "",
        "config.py": "from engine.cluster import messages\n",  # a leaf importing the cluster
        "cluster/__init__.py": "",
        "cluster/messages.py": "def f():\n    from engine.core import request\n",
        "core/__init__.py": "",
        "core/request.py": "import engine.config\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    wrong = upward_imports(import_graph(tmp_path, "engine"))
    assert len(wrong) == 1 and wrong[0].startswith("engine.config (plain values")
    assert "imports engine.cluster.messages (cluster" in wrong[0]


def long_files(root: Path) -> list[str]:
    out = []
    for path in sorted((root / "engine").rglob("*")):
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                out.append(f"{path.relative_to(root)}: {lines} lines")
    return out


def test_no_file_of_engine_is_over_500_lines():
    wrong = long_files(ROOT)
    assert not wrong, f"split these along a seam (at most {MAX_LINES} lines):\n" + "\n".join(wrong)


def test_the_size_check_counts_c_sources_too(tmp_path):
    (tmp_path / "engine" / "kernels").mkdir(parents=True)
    (tmp_path / "engine" / "kernels" / "k.c").write_text("x;\n" * (MAX_LINES + 1))
    (tmp_path / "engine" / "a.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"engine/kernels/k.c: {MAX_LINES + 1} lines"]
