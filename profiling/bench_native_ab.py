"""Two builds of the C kernels in one engine, alternated decode step by decode step: the working
tree's against those of a git revision.

    .venv/bin/python profiling/bench_native_ab.py --base HEAD~1
    .venv/bin/python profiling/bench_native_ab.py --base main --quantization int8 --runs 5
    ENGINE_CPU_ISA=avx2 .venv/bin/python profiling/bench_native_ab.py --base HEAD~1

Builds engine/kernels/native/ as it is at ``--base`` with the engine's compiler and target flags
(under ENGINE_CPU_ISA, as the engine builds its own), loads both libraries in one process, and
generates with the embedded engine (``--batch`` requests at a time, greedy, fixed length), handing
the decode steps to the two builds in turn (each step's C layers, LM head and other kernel calls).
On a shared machine a drift then hits both alike, where two runs one after the other differ by
10-20%. Prints, per build, the decode steps' median, p10 and mean time of the C decoder layers
(every layer of a step, ``NativeDecoder.run``) and of the whole step, and how often the working
tree's build was the faster of two adjacent steps. The base's structs must match the working tree's
ctypes mirrors (the script says where not).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import engine
from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.kernels import native
from engine.layers import native_decode

REPO = Path(engine.__file__).resolve().parents[1]
NATIVE = "engine/kernels/native"
PROMPT = "Tell me a long story about a robot who learns to paint, with every colour it finds. "


def build_at(rev: str, out: Path) -> Path:
    """The kernels of ``rev`` compiled into ``out``/libengine_native.so."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"git {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    names = [Path(p).name for p in git("ls-tree", "--name-only", rev, NATIVE + "/").split()]
    for name in names:
        if name.endswith((".c", ".h")):
            (out / name).write_text(git("show", f"{rev}:{NATIVE}/{name}"))
    cc = native.compiler()
    if cc is None:
        sys.exit("no C compiler (set CC, or install gcc)")
    target = out / "libengine_native.so"
    sources = sorted(str(p) for p in out.glob("*.c"))
    subprocess.run([cc, *native.compile_flags(), *sources, "-o", str(target), "-lm"], check=True)
    return target


class Alternation:
    """Hands each decode step to the libraries in turn (its C layers, then its LM head and any
    other kernel call until the next decode step) and times its parts."""

    def __init__(self, libs: dict[str, object]) -> None:
        self.libs, self.names = libs, list(libs)
        self.current = self.names[0]
        self.runs = 0
        self.decoded = False
        self.times: dict[tuple[str, str], list[float]] = {
            (part, n): [] for part in ("layers", "step") for n in self.names
        }

    def install(self) -> None:
        run, step = native_decode.NativeDecoder.run, LLMEngine.step
        alt = self

        def timed_run(self, *args, **kwargs):
            alt.current = alt.names[alt.runs % len(alt.names)]  # decode steps in turn
            alt.runs += 1
            self.lib = alt.libs[alt.current]
            t = time.perf_counter()
            out = run(self, *args, **kwargs)
            alt.times[("layers", alt.current)].append(time.perf_counter() - t)
            alt.decoded = True
            return out

        def timed_step(self):
            alt.decoded = False
            t = time.perf_counter()
            out = step(self)
            if alt.decoded:  # decode steps only: a prefill runs the torch layers
                alt.times[("step", alt.current)].append(time.perf_counter() - t)
            return out

        native_decode.NativeDecoder.run = timed_run
        LLMEngine.step = timed_step
        # the C LM head and every other kernel call of the step: the step's library
        native.library_for = lambda **tensors: alt.libs[alt.current]


def summary(alt: Alternation) -> None:
    base, work = alt.names
    print(f"{'part':<7} {'build':<8} {'steps':>6} {'median ms':>10} {'p10 ms':>8} {'mean ms':>8}")
    for part in ("layers", "step"):
        for n in alt.names:
            v = sorted(alt.times[(part, n)])
            if v:
                print(
                    f"{part:<7} {n:<8} {len(v):>6} {statistics.median(v) * 1e3:>10.3f} "
                    f"{v[len(v) // 10] * 1e3:>8.3f} {statistics.mean(v) * 1e3:>8.3f}"
                )
        a, b = alt.times[(part, base)], alt.times[(part, work)]
        n = min(len(a), len(b))
        if n:
            wins = sum(1 for i in range(n) if b[i] < a[i])
            ratio = statistics.median(a) / statistics.median(b)
            print(f"{part}: {work} faster in {wins} of {n} adjacent pairs; median {ratio:.3f}x")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", default="HEAD", help="git revision of the other build")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=[None, "int8"])
    ap.add_argument("--tokens", type=int, default=300, help="output tokens per request")
    ap.add_argument("--runs", type=int, default=3, help="generate calls, one after the other")
    ap.add_argument(
        "--batch", type=int, default=1, help="requests per call, decoded together (C layers: <= 16)"
    )
    args = ap.parse_args()
    work = native.library()
    if work is None:
        sys.exit("the C kernels cannot be built here")
    with tempfile.TemporaryDirectory() as tmp:
        base = native.load_library(build_at(args.base, Path(tmp)))
    print(f"base {args.base} against the working tree; CPU paths: {native.row_dot_paths()}")
    alt = Alternation({"base": base, "work": work})
    # no prefix caching: every run a whole prefill, then its decode steps (a prompt cached but
    # for one token would add a 1-token step that runs the C layers too)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        enable_prefix_caching=False,
    )
    alt.install()
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    try:
        for _ in range(args.runs):
            llm.generate([f"Story {i}. " + PROMPT * 4 for i in range(args.batch)], params)
    finally:
        llm.close()
    summary(alt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
