"""The router's contract with its placement is one protocol: every ``self.placement.<hook>`` a
module of the router's package calls is declared on ``placement.Placement`` (and nothing more
is), has a default on ``PlacementBase``, and exists with the protocol's parameters on every
implementation; the router calls its placement directly, never through ``getattr``."""

from __future__ import annotations

import ast
import inspect
import pkgutil
from importlib import import_module

import pytest

from engine.cluster import router
from engine.cluster.conductor.adapter import ConductorPlacement
from engine.cluster.placement import Placement, PlacementBase, RoundRobin

IMPLEMENTATIONS = [PlacementBase, RoundRobin, ConductorPlacement]


def _is_self_placement(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "placement"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def router_trees() -> list[ast.AST]:
    """Every module of the router's package, parsed."""
    names = [f"{router.__name__}.{i.name}" for i in pkgutil.iter_modules(router.__path__)]
    assert {"engine.cluster.router.membership", "engine.cluster.router.phases"} <= set(names)
    return [ast.parse(inspect.getsource(import_module(n))) for n in [router.__name__, *names]]


def router_hooks() -> set[str]:
    """The names the router reads off ``self.placement``."""
    return {
        node.attr
        for tree in router_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_self_placement(node.value)
    }


def protocol_hooks() -> set[str]:
    return {
        name
        for name, value in vars(Placement).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


def test_the_protocol_lists_exactly_the_hooks_the_router_calls():
    called = router_hooks()
    assert {"place", "rejection_error", "planned_copies", "bind", "finished"} <= called
    assert called == protocol_hooks()


def test_the_router_never_asks_its_placement_with_getattr():
    for node in (n for tree in router_trees() for n in ast.walk(tree)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr") and node.args:
                assert not _is_self_placement(node.args[0]), ast.unparse(node)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("hook", sorted(protocol_hooks()))
def test_every_implementation_has_every_hook_with_the_protocols_parameters(impl, hook):
    want = list(inspect.signature(getattr(Placement, hook)).parameters)
    got = list(inspect.signature(getattr(impl, hook)).parameters)
    assert got == want, f"{impl.__name__}.{hook}{got} != Placement.{hook}{want}"


def test_the_base_answers_nothing_and_hears_nothing():
    base = RoundRobin()
    assert base.rejection_error() is None
    assert list(base.planned_copies()) == []
    assert base.on_event("w", {"type": "stored", "keys": []}) is False
    base.bind("r/0")
    base.prefill_started("r/0", 0.0)
    base.copy_done("r/0", 3)
    base.prefill_done("r/0", 1.0, 16)
    base.finished("r/0", 2.0, 5)
    base.worker_joined("w", "prefill", 0.0)
    base.worker_left("w", 1.0)
    base.decode_progress("d", 1.0, 2.0, 100.0, 0.01)
