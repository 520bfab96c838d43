"""profiling/ holds command lines only: every script parses its arguments (`--help` exits 0; two
merged features once added the same option to one script, which then failed before measuring
anything), and none edits ``sys.path`` or imports another script: what scripts share, and what
tests import, lives in the installed package (engine/bench/, engine/sim/), so
``python profiling/X.py`` runs as it is, from any directory."""

from __future__ import annotations

import ast
import glob
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILING = os.path.join(ROOT, "profiling")
FILES = sorted(glob.glob(os.path.join(PROFILING, "*.py")))
SCRIPTS = [p for p in FILES if "__main__" in open(p).read()]
NAMES = {os.path.splitext(os.path.basename(p))[0] for p in FILES}


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_help_exits_zero(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(path, run_name="__main__")
    assert exc.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def offences(path: str, scripts: set[str]) -> list[str]:
    """Where the file at ``path`` touches ``sys.path`` or imports ``profiling`` or one of
    ``scripts`` (another script, by module name), as 'file:line: what'."""
    tree = ast.parse(open(path).read(), filename=path)
    here = os.path.splitext(os.path.basename(path))[0]
    out = []

    def bad_module(name: str) -> bool:
        top = name.split(".")[0]
        return top == "profiling" or (top in scripts and top != here)

    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr == "path":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                what = "sys.path"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "sys" and any(a.name == "path" for a in node.names):
                what = "from sys import path"
            elif bad_module(node.module):
                what = f"from {node.module} import ..."
        elif isinstance(node, ast.ImportFrom) and node.level:
            what = "a relative import"
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if bad_module(a.name)]
            if names:
                what = "import " + ", ".join(names)
        if what:
            out.append((node.lineno, what))
    return [f"{os.path.relpath(path, ROOT)}:{n}: {what}" for n, what in sorted(out)]


def test_no_script_edits_sys_path_or_imports_another():
    assert len(SCRIPTS) > 15, "the glob should see profiling/'s scripts"
    found = [line for p in FILES for line in offences(p, NAMES)]
    assert not found, "\n".join(found)


def test_nothing_outside_profiling_imports_it():
    paths = glob.glob(os.path.join(ROOT, "engine", "**", "*.py"), recursive=True)
    paths += glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
    found = [line for p in sorted(paths) for line in offences(p, set())]
    found = [line for line in found if "sys.path" not in line and "relative" not in line]
    assert not found, "\n".join(found)


def test_the_check_sees_each_kind_of_offence(tmp_path):
    script = tmp_path / "a.py"
    script.write_text(
        "import sys\nimport os.path\n"
        "sys.path.insert(0, '.')\n"
        "from sys import path\n"
        "from profiling.sim_trace import load_trace\n"
        "import b\n"
        "from . import c\n"
        "import a\n"  # itself: no offence
    )
    lines = [line.split(": ", 1)[1] for line in offences(str(script), {"a", "b"})]
    assert lines == [
        "sys.path",
        "from sys import path",
        "from profiling.sim_trace import ...",
        "import b",
        "a relative import",
    ]


def test_bench_peer_isa_runs_itself_under_the_cap():
    """``bench_peer.py --isa avx2`` starts again under ENGINE_CPU_ISA=avx2 (torch reads its caps
    once, at import) and says which CPU and level its figures come from before anything else."""
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(PROFILING, "bench_peer.py"),
            "--isa",
            "avx2",
            "--model",
            "/no.gguf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "ENGINE_CPU_ISA"},
    )
    assert out.returncode != 0 and "model path /no.gguf does not exist" in out.stderr
    assert "ISA level avx2" in out.stdout.splitlines()[0]


def test_bench_int8_prefetch_builds_and_times_both_passes():
    """``bench_int8.py --prefetch`` builds its C harness against the engine's gemv.h with the
    engine's compiler flags and times the row dots, int8 and bf16 weights, with their prefetch
    and without."""
    from engine.kernels import native

    if native.compiler() is None:
        pytest.skip("no C compiler")
    out = subprocess.run(
        [sys.executable, os.path.join(PROFILING, "bench_int8.py"), "--prefetch", "--reps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = {tuple(line.split()[:2]): line.split()[-1] for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {(w, p) for w in ("int8", "bfloat16") for p in ("on", "off")}
    assert all(float(gbs) > 0 for gbs in rows.values())


def test_bench_native_ab_builds_a_revision_and_alternates_the_two_builds():
    """``bench_native_ab.py`` builds the C kernels of a git revision, loads them beside the
    working tree's and hands the engine's decode steps to each in turn."""
    from engine.kernels import native

    if native.compiler() is None:
        pytest.skip("no C compiler")
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    cmd = [sys.executable, os.path.join(PROFILING, "bench_native_ab.py"), "--base", "HEAD"]
    out = subprocess.run(
        [*cmd, "--quantization", "int8", "--tokens", "8", "--runs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    steps = {(r[0], r[1]): int(r[2]) for r in rows if r[:1] in (["layers"], ["step"])}
    # 2 requests x 7 decode steps, handed to the two builds in turn
    assert {k: v for k, v in steps.items() if k[0] == "layers"} == {
        ("layers", "base"): 7,
        ("layers", "work"): 7,
    }
    assert any(line.startswith("layers: work faster in") for line in out.stdout.splitlines())


def test_bench_product_peak_builds_for_the_class_and_times_its_mixes():
    """``bench_product_peak.py`` builds profiling/product_peak.c with the engine's target flags:
    under the AVX2 cap only the ymm mixes, each with a positive rate, and no torch warning."""
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(PROFILING, "bench_product_peak.py"),
            "--iterations",
            "200000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ENGINE_CPU_ISA": "avx2"},
    )
    assert out.returncode == 0, out.stderr
    assert "ISA level avx2" in out.stdout.splitlines()[0]
    rows = [
        r.split("|")[1:-1]
        for r in out.stdout.splitlines()
        if r.startswith("| ") and "GMAC" not in r
    ]
    rows = [[c.strip() for c in r] for r in rows if not r[0].startswith(" ---")]
    assert [r[0] for r in rows] == ["fma f32 ymm", "int16 ymm", "int8 ymm"]
    assert [r[1] for r in rows] == ["8", "16", "32"]
    assert all(float(r[2]) > 0 for r in rows)
    assert "torch was imported before engine" not in out.stderr


FAKE_BATCHED_BENCH = """#!{python}
# llama-batched-bench's contract as bench_kv_dtype.py uses it: one JSONL row per -npl entry
import json, sys
a = sys.argv[1:]
open({log!r}, "a").write(" ".join(a) + "\\n")
for pl in a[a.index("-npl") + 1].split(","):
    row = dict(pp=int(a[a.index("-npp") + 1]), tg=32, pl=int(pl), t_tg=1.024 * int(pl))
    print(json.dumps({{**row, "speed_tg": 1.0}}))
"""


def test_bench_kv_dtype_decode_runs_llama_batched_bench_beside_the_engine(tmp_path):
    """``bench_kv_dtype.py decode --llama-batched-bench PATH`` runs llama.cpp's benchmark at the
    engine's prompt lengths and batches (prompt once, one KV copy; YaRN mapped to its flags) and
    prints its rows and the engine's ratio to them."""
    log = tmp_path / "args.txt"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(FAKE_BATCHED_BENCH.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    yarn = '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}'
    cmd = [sys.executable, os.path.join(PROFILING, "bench_kv_dtype.py"), "decode"]
    cmd += ["--contexts", "64", "--batches", "1", "2", "--kv-dtypes", "auto"]
    cmd += ["--rope-scaling", yarn, "--llama-batched-bench", str(fake)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    args = log.read_text().split()
    assert args[args.index("-npp") + 1] == "64" and args[args.index("-npl") + 1] == "1,2"
    assert "-pps" in args and "-kvu" in args
    assert args[args.index("--rope-scaling") + 1] == "yarn"
    assert args[args.index("--rope-scale") + 1] == "2.0"
    assert args[args.index("--yarn-orig-ctx") + 1] == "8192"
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert "| llama.cpp (F16) | 64 | 2 | 64.0 ms | 31.2 | 1.00x |" in table
    engine = [row for row in table if row.startswith("| auto | 64 |")]
    assert len(engine) == 2 and all(row.endswith("x |") for row in engine)
