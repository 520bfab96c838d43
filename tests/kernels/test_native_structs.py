"""The C structs Python passes (engine/kernels/native/structs.py): the library's layouts agree with
their ctypes mirrors, and a mirror that differs (a field added, dropped, retyped or moved) is
named by the check and stops the load. The offsets in the messages are those of an LP64 machine
(x86-64, aarch64)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from engine.kernels import native
from engine.kernels.native import structs

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    assert lib is not None, native._state.get("error")
    return lib


def _mirror(name: str, fields: list) -> type[ctypes.Structure]:
    """A ctypes struct named as a C one (the check matches them by name)."""
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _replace(cls, name, new):
    """cls's fields with field ``name`` replaced by the fields ``new`` (none: dropped)."""
    out = []
    for field in cls._fields_:
        out += new if field[0] == name else [field]
    return out


def test_the_real_structs_agree(lib):
    c = structs.c_layouts(lib)
    assert set(c) == {cls.__name__ for cls in structs.MIRRORED} == {"Proj", "Layer", "Step"}
    for cls in structs.MIRRORED:
        assert c[cls.__name__].size == ctypes.sizeof(cls)
        assert [f.name for f in c[cls.__name__].fields] == [f[0] for f in cls._fields_]
        assert [f.offset for f in c[cls.__name__].fields] == [
            getattr(cls, f[0]).offset for f in cls._fields_
        ]
    assert structs.check(lib) == []
    assert c["Layer"].fields[15] == structs.CField("qkv", "Proj", 80, ctypes.sizeof(structs.Proj))


def _problems(lib, cls) -> str:
    return "; ".join(structs.compare(cls, structs.c_layouts(lib)[cls.__name__]))


def test_a_field_added_at_the_end_is_named(lib):
    step = _mirror("Step", [*structs.Step._fields_, ("extra", ctypes.c_int64)])
    msg = _problems(lib, step)
    assert "Step.extra (c_long at offset 96" in msg or "Step.extra (c_longlong" in msg
    assert "not in C, which ends after max_pos" in msg
    assert "Step: sizeof 96 in C, 104 in ctypes" in msg


def test_a_field_added_in_the_middle_is_named(lib):
    proj = _mirror(
        "Proj", _replace(structs.Proj, "w", [("flags", ctypes.c_int), ("w", ctypes.c_void_p)])
    )
    msg = _problems(lib, proj)
    assert msg.startswith("Proj field 1: C has w (const void * at offset 8, size 8), ctypes flags")


def test_a_dropped_field_is_named(lib):
    layer = _mirror("Layer", _replace(structs.Layer, "sv_h", []))
    msg = _problems(lib, layer)
    assert "Layer.sv_h (int64_t at offset 368, size 8) is in C but not in the ctypes mirror" in msg
    assert "Layer: sizeof 376 in C, 368 in ctypes" in msg


@pytest.mark.parametrize(
    "field, ctype, expect",
    [
        # Another size: everything after it moves.
        ("eps", ctypes.c_double, "Layer.eps: C has float at offset 36, size 4, ctypes c_double"),
        # Same size and offset, another kind: only the types tell.
        (
            "eps",
            ctypes.c_int,
            "Layer.eps: C has float at offset 36, size 4, ctypes c_int at offset 36",
        ),
        ("ln1", ctypes.c_int64, "Layer.ln1: C has const void * at offset 48, size 8, ctypes c_l"),
        (
            "num_blocks",
            ctypes.c_void_p,
            "Layer.num_blocks: C has int64_t at offset 320, size 8, ctypes c_void_p",
        ),
    ],
)
def test_a_field_with_another_type_is_named(lib, field, ctype, expect):
    layer = _mirror("Layer", _replace(structs.Layer, field, [(field, ctype)]))
    assert expect in _problems(lib, layer)


def test_a_nested_struct_of_another_type_is_named(lib):
    other = _mirror("Other", structs.Proj._fields_)  # same layout, another struct
    layer = _mirror("Layer", _replace(structs.Layer, "o", [("o", other)]))
    assert (
        _problems(lib, layer)
        == "Layer.o: C has Proj at offset 136, size 56, ctypes Other at offset 136, size 56"
    )


def test_reordered_fields_are_named(lib):
    fields = list(structs.Step._fields_)
    fields[0], fields[1] = fields[1], fields[0]  # same types: only the names tell
    msg = _problems(lib, _mirror("Step", fields))
    assert msg == (
        "Step field 0: C has rows (int at offset 0, size 4), "
        "ctypes threads (c_int at offset 0, size 4)"
    )
    fields = _replace(structs.Proj, "wt", [])  # wt moved to the end
    msg = _problems(lib, _mirror("Proj", [*fields, ("wt", ctypes.c_int)]))
    assert msg.startswith("Proj field 0: C has wt (int at offset 0, size 4), ctypes w (c_void_p")


def test_a_struct_on_one_side_only_is_named(lib):
    problems = structs.check(
        lib, (structs.Proj, structs.Layer, _mirror("Extra", [("a", ctypes.c_int)]))
    )
    assert "Extra is mirrored in ctypes but not reported by C" in problems
    assert "Step is reported by C but has no ctypes mirror" in problems


def test_a_library_whose_structs_differ_is_not_loaded(monkeypatch, caplog):
    wrong = _mirror("Step", _replace(structs.Step, "slots", [("slots", ctypes.c_int)]))
    monkeypatch.setattr(structs, "MIRRORED", (structs.Proj, structs.Layer, wrong))
    monkeypatch.delenv("ENGINE_KERNELS", raising=False)
    monkeypatch.setattr(native, "_state", {})
    with caplog.at_level(logging.WARNING, logger="engine.kernels.native"):
        assert native.library() is None  # the torch references serve
    assert "Step.slots: C has const int64_t * at offset 16, size 8, ctypes c_int" in caplog.text
    assert native.library_path() is None
    monkeypatch.setenv("ENGINE_KERNELS", "native")
    with pytest.raises(native.NativeUnavailable, match=r"differ in .*Step\.slots"):
        native.library()
    monkeypatch.setattr(native, "_state", {})  # the next test loads afresh
