"""engine/sim/ and engine/bench/ sit above the engine: they may import any of it, but nothing else
in engine/ imports them (the simulator and the benchmarks are never part of a serving process),
and engine/sim imports nothing of engine/bench (the simulator needs no benchmark)."""

from __future__ import annotations

from test_import_graph import ROOT, import_graph

ABOVE = ("engine.sim", "engine.bench")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_imports_neither_the_simulator_nor_the_benchmarks():
    graph = import_graph(ROOT, "engine")
    assert "engine.sim" in graph and "engine.bench" in graph
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not any(_in(module, p) for p in ABOVE)
        for target in targets
        if any(_in(target, p) for p in ABOVE)
    )
    wrong += sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _in(module, "engine.sim")
        for target in targets
        if _in(target, "engine.bench")
    )
    assert not wrong, "\n".join(wrong)
