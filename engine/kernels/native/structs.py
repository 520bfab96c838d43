"""The ctypes mirrors of the C structs Python passes to the kernels, and their check against C.

decode_layer.c declares each struct it takes from Python (``Proj``, ``Layer``, ``Step``) by one
field list, from which come both the typedef and the layout ``engine_struct_layout`` reports
(every field's name, C type, offset and size, and the struct's sizeof). ``MIRRORED`` below is the
one list of the structs Python mirrors; the loader (``native._load``) runs ``check`` on every
load and refuses a library whose structs differ from these, so a field added, moved or retyped on
one side only cannot silently shift the other's. A class here is named as its C typedef.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_C, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Proj(ctypes.Structure):
    """A projection y = x W^T (* scales) (+ bias): weight code, w, scales, bias, n, k."""

    _fields_ = [
        ("wt", _C),
        ("w", _P),
        ("scales", _P),
        ("bias", _P),
        ("panels", _P),
        ("n", _I64),
        ("k", _I64),
    ]


class Layer(ctypes.Structure):
    """One decoder layer: shapes, norms, projections and its KV cache views."""

    _fields_ = [
        ("dt", _C),
        *((name, _C) for name in ("hidden", "heads", "kv_heads", "dim", "inter", "qk_norm")),
        ("block_size", _C),
        ("kdt", _C),
        ("eps", _F),
        ("scale", _F),
        *((name, _P) for name in ("ln1", "ln2", "q_norm", "k_norm")),
        *((name, Proj) for name in ("qkv", "o", "gate_up", "down")),
        ("k_cache", _P),
        ("v_cache", _P),
        *((name, _I64) for name in ("num_blocks", "sk_b", "sk_s", "sk_h", "sv_b", "sv_s", "sv_h")),
    ]


class Step(ctypes.Structure):
    """One decode step: its rows, their positions, slots and block tables, the rotary tables."""

    _fields_ = [
        ("rows", _C),
        ("threads", _C),
        *((name, _P) for name in ("positions", "slots", "block_tables", "seq_lens", "row_tables")),
        ("table_rows", _I64),
        ("table_width", _I64),
        ("s_bt", _I64),
        ("cos", _P),
        ("sin_signed", _P),
        ("max_pos", _I64),
    ]


# The structs Python mirrors: each must match the C struct of its name, and C reports no other.
MIRRORED: tuple[type[ctypes.Structure], ...] = (Proj, Layer, Step)

# engine_struct_layout(which, field, &name, &type, &offset, &size) -> field count, -1 past the end
SIGNATURE = [_C, _C] + [ctypes.POINTER(ctypes.c_char_p)] * 2 + [ctypes.POINTER(_I64)] * 2


@dataclass(frozen=True)
class CField:
    name: str
    type: str  # as written in decode_layer.c's field list: "int", "const void *", "Proj"
    offset: int
    size: int


@dataclass(frozen=True)
class CStruct:
    name: str
    size: int
    fields: tuple[CField, ...]


def c_layouts(lib: ctypes.CDLL) -> dict[str, CStruct]:
    """Every struct the library reports through engine_struct_layout, by name."""
    fn = lib.engine_struct_layout
    name, ctype = ctypes.c_char_p(), ctypes.c_char_p()
    offset, size = _I64(), _I64()

    def entry(which: int, field: int) -> int:
        return fn(which, field, *(ctypes.byref(v) for v in (name, ctype, offset, size)))

    out: dict[str, CStruct] = {}
    which = 0
    while (count := entry(which, -1)) >= 0:
        struct_name, struct_size, fields = name.value.decode(), size.value, []
        for i in range(count):
            entry(which, i)
            fields.append(
                CField(name.value.decode(), ctype.value.decode(), offset.value, size.value)
            )
        out[struct_name] = CStruct(struct_name, struct_size, tuple(fields))
        which += 1
    return out


# The integer spellings a field list may use; any other non-pointer, non-float type is a struct.
_C_INTS = {"char", "short", "int", "unsigned", "unsigned int", "long", "long long", "size_t"}
_C_INTS |= {f"{u}int{b}_t" for u in ("", "u") for b in (8, 16, 32, 64)}


def _kind(c_type: str) -> str:
    """The kind of a C field type: pointer, float, int, or else a struct (its typedef name)."""
    if "*" in c_type:
        return "pointer"
    if c_type in ("float", "double"):
        return "float"
    return "int" if c_type in _C_INTS else c_type


def _ctypes_kind(t: type) -> str:
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return t.__name__
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "pointer"
    if t in (ctypes.c_float, ctypes.c_double):
        return "float"
    return "int"


def compare(cls: type[ctypes.Structure], c: CStruct) -> list[str]:
    """How the ctypes mirror ``cls`` differs from the C layout ``c``: the first field that differs
    (name, kind, offset or size; the ones after it follow from it) and the sizeof. Empty if they
    agree."""
    s, problems = cls.__name__, []
    py = [(name, t, getattr(cls, name)) for name, t, *_ in cls._fields_]
    for i in range(max(len(py), len(c.fields))):
        if i >= len(c.fields):
            name, t, desc = py[i]
            problems.append(
                f"{s}.{name} ({t.__name__} at offset {desc.offset}) is in the ctypes mirror "
                f"but not in C, which ends after {c.fields[-1].name if c.fields else 'nothing'}"
            )
            break
        cf = c.fields[i]
        where = f"{cf.type} at offset {cf.offset}, size {cf.size}"
        if i >= len(py):
            problems.append(f"{s}.{cf.name} ({where}) is in C but not in the ctypes mirror")
            break
        name, t, desc = py[i]
        mine = f"{t.__name__} at offset {desc.offset}, size {desc.size}"
        if name != cf.name:
            problems.append(f"{s} field {i}: C has {cf.name} ({where}), ctypes {name} ({mine})")
            break
        if (_kind(cf.type), cf.offset, cf.size) != (_ctypes_kind(t), desc.offset, desc.size):
            problems.append(f"{s}.{name}: C has {where}, ctypes {mine}")
            break
    if ctypes.sizeof(cls) != c.size:
        problems.append(f"{s}: sizeof {c.size} in C, {ctypes.sizeof(cls)} in ctypes")
    return problems


def check(
    lib: ctypes.CDLL, mirrored: tuple[type[ctypes.Structure], ...] | None = None
) -> list[str]:
    """Every difference between the library's structs and their ctypes mirrors (``MIRRORED``
    unless given; empty: they agree), including a struct on one side only."""
    mirrored = MIRRORED if mirrored is None else mirrored
    c = c_layouts(lib)
    names = [cls.__name__ for cls in mirrored]
    problems = [f"{n} is mirrored in ctypes but not reported by C" for n in names if n not in c]
    problems += [f"{n} is reported by C but has no ctypes mirror" for n in c if n not in names]
    for cls in mirrored:
        if cls.__name__ in c:
            problems += compare(cls, c[cls.__name__])
    return problems
