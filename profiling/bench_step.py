"""One decode step, taken apart: forward time, the attention share, and the top ops.

    .venv/bin/python profiling/bench_step.py                       # batch 64 x 512, batch 1 x 4096
    .venv/bin/python profiling/bench_step.py --cases 64x512 16x4096 --dtype bfloat16 --profile
    .venv/bin/python profiling/bench_step.py --weight-dtype float32 bfloat16 --prefill 1024

Each case is BATCHxCONTEXT: BATCH sequences decode one token each over CONTEXT cached tokens (random
KV written into the paged cache's blocks first, so that the attention reads memory). "attention" is
the paged decode attention of every layer timed alone on the same inputs (one layer's cache, through
its Python launcher); its share is of the forward. Decode steps of up to 16 sequences (MAX_ROWS) run
the C decoder layers (layers/native_decode.py), where the same attention kernel runs without the
launcher, so there the column overstates it by the launcher's ~20 us per layer
(ENGINE_KERNELS=torch: the torch layers).
``--profile`` adds torch.profiler's top ops by self CPU time. ``--layers both`` times every case's
step through the torch layers and through the C decoder layers (forced on, whatever the engine
chose), one step of each in turn, so that a shared machine's drift hits both alike; ``--floor``
adds the batch-1 bound of streaming the model's weights once per token at this machine's GEMV
bandwidth (engine/bench/machine.py, measured in the same run).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import kernels
from engine.config import CacheConfig, EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.layers.attention_metadata import AttentionMetadata


def decode_inputs(batch: int, context: int, block_size: int, num_blocks: int, vocab: int):
    per_seq = -(-context // block_size)
    if batch * per_seq > num_blocks:
        raise SystemExit(f"{batch}x{context} needs {batch * per_seq} blocks, have {num_blocks}")
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    pos = seq_lens.long() - 1
    slots = tables[torch.arange(batch), pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=batch,
        decode_block_tables=tables,
        decode_seq_lens=seq_lens,
        decode_max_seq_len=context,
    )
    ids = torch.randint(0, vocab, (batch,))
    return ids, pos, meta


def fill_kv(engine, batch: int, context: int) -> None:
    """Random values in the cache blocks a case reads, in every layer. Never written, they would
    read as the kernel's shared zero page (one physical page for all of them, always in cache)
    instead of memory, which the attention of a real step streams."""
    bs = engine.cache.block_size
    used = batch * -(-context // bs)
    g = torch.Generator().manual_seed(0)
    kv = engine.cache.kv
    kv[:, :, :used].copy_(torch.randn(kv[:, :, :used].shape, generator=g).to(kv.dtype))


def timed(fn, reps: int) -> float:
    """Best of ``reps`` calls, in process CPU seconds when --cpu-time (robust to other processes
    taking the cores; use it with one thread), else wall seconds."""
    return timed_in_turn([fn], reps)[0]


def timed_in_turn(fns, reps: int) -> list[float]:
    """Best of ``reps`` calls of each of ``fns``, called in turn (one of each per round)."""
    clock = time.process_time if CPU_TIME else time.perf_counter
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


CPU_TIME = False


def with_layers(model, layers: str, fn):
    """``fn`` run with the decoder layers ``layers`` names: "engine" (its choice), "torch" or "c"
    (the C decoder layers forced on; the step must be one they take)."""
    if layers == "engine":
        return fn

    def run():
        chosen = model.native_decode
        model.native_decode = layers == "c"
        try:
            return fn()
        finally:
            model.native_decode = chosen

    return run


@torch.inference_mode()
def run_case(
    engine: LLMEngine, batch: int, context: int, reps: int, profile: bool, layers: list[str]
) -> dict:
    model, cfg = engine.model, engine.model_config
    ids, pos, meta = decode_inputs(
        batch, context, engine.cache.block_size, engine.cache.num_blocks, cfg.vocab_size
    )
    runner = engine.runner
    fill_kv(engine, batch, context)

    def step():
        hidden = runner.forward(ids, pos, meta)
        return model.compute_logits(hidden).float()

    steps = timed_in_turn([with_layers(model, name, step) for name in layers], reps)
    step_s = steps[0]
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=engine.dtype)
    layer = model.layers[0].attn
    out = torch.empty_like(q)

    def attention():
        for _ in range(cfg.num_layers):
            kernels.decode_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                layer.scale,
                out=out,
                max_seq_len=context,
            )

    attn_s = timed(attention, reps)
    res = {"batch": batch, "context": context, "step_ms": step_s * 1e3, "attn_ms": attn_s * 1e3}
    res["steps_ms"] = {name: s * 1e3 for name, s in zip(layers, steps)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU]) as p:
            step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument(
        "--pack-weights", action=argparse.BooleanOptionalAction, default=True,
        help="bf16 weights packed for oneDNN (EngineConfig.pack_weights)",
    )  # fmt: skip
    ap.add_argument("--cases", nargs="+", default=["64x512", "1x4096"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="time in process CPU seconds")
    ap.add_argument(
        "--layers", choices=("engine", "torch", "c", "both"), default="engine",
        help="decoder layers: the engine's choice, torch, C (forced on), or torch and C in turn",
    )  # fmt: skip
    ap.add_argument("--floor", action="store_true", help="the batch-1 weight-streaming bound")
    ap.add_argument(
        "--weight-dtype", nargs="+", default=["auto"],
        help="EngineConfig.weight_dtype; several: one engine each, their steps timed in turn",
    )  # fmt: skip
    ap.add_argument(
        "--prefill", type=int, nargs="*", default=[],
        help="also time prompts of these many tokens prefilled alone (one output token)",
    )  # fmt: skip
    args = ap.parse_args()
    if len(args.weight_dtype) > 1 and args.layers != "engine":
        raise SystemExit("--weight-dtype with several values times the engine's layers only")
    layers = ["torch", "c"] if args.layers == "both" else [args.layers]
    global CPU_TIME
    CPU_TIME = args.cpu_time
    extra = {}
    if args.quantization:
        extra["quantization"] = args.quantization
    if args.compile is not None:
        extra["compile"] = args.compile
    extra["pack_weights"] = args.pack_weights
    engines = {
        w: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                weight_dtype=w,
                device="cpu",
                # the prefill cases repeat one prompt: computed each time, never a cache hit
                cache=CacheConfig(
                    kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=False
                ),
                **extra,
            )
        )
        for w in args.weight_dtype
    }
    engine = next(iter(engines.values()))
    weights = args.quantization or ", ".join(
        str(e.model.weight_dtype).removeprefix("torch.") for e in engines.values()
    )
    print(
        f"torch threads {torch.get_num_threads()}, dtype {engine.dtype}, weights {weights}, "
        f"quantization {args.quantization}, compile {engine.runner.compiled}, "
        f"packed {bool(engine.runner.packed)}, "
        f"{'process CPU' if args.cpu_time else 'wall'} time, best of {args.reps}"
    )
    if args.floor:
        from engine.bench.machine import ceilings

        model = engine.model
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for lin in (model.lm_qweight, model.lm_scales):  # int8: the LM head's GEMM reads these
            nbytes += 0 if lin is None else lin.numel() * lin.element_size()
        key = "float32" if engine.dtype == torch.float32 else "bfloat16"
        gb_s = ceilings()[f"gemv_gb_s_torch.{key}"]
        print(
            f"batch-1 floor: {nbytes / 1e6:.0f} MB of weights per token at {gb_s:.1f} GB/s "
            f"({key} GEMV now): {nbytes / gb_s / 1e6:.1f} ms, {gb_s * 1e9 / nbytes:.1f} tok/s"
        )
    head = ("batch x context", "layers", "step ms", "attn ms", "attn share", "tok/s", "ms/tok")
    widths = (16, 7, 9, 9, 11, 8, 8)
    print(" ".join(f"{h:>{w}s}" for h, w in zip(head, widths)))
    for case in args.cases:
        b, c = (int(x) for x in case.split("x"))
        if len(engines) > 1:
            r = run_case_in_turn(engines, b, c, args.reps)
        else:
            r = run_case(engine, b, c, args.reps, args.profile, layers)
        for name, ms in r["steps_ms"].items():
            print(
                f"{case:>16s} {name:>7s} {ms:9.1f} {r['attn_ms']:9.1f} "
                f"{r['attn_ms'] / ms:11.1%} {b / ms * 1e3:8.1f} {ms / b:8.2f}"
            )
    for tokens in args.prefill:
        best = time_prefills(engines, tokens, args.reps)
        for name, s in best.items():
            held = args.quantization or name  # int8 projections: not their float dtype
            print(f"prefill of {tokens} tokens, weights {held}: {s * 1e3:.0f} ms")


def run_case_in_turn(engines: dict, batch: int, context: int, reps: int) -> dict:
    """One decode step of every engine (by weight dtype), timed in turn; the attention column is
    the first engine's (the weights do not change it)."""
    fns = []
    for e in engines.values():
        fill_kv(e, batch, context)
        ids, pos, meta = decode_inputs(
            batch, context, e.cache.block_size, e.cache.num_blocks, e.model_config.vocab_size
        )

        @torch.inference_mode()
        def step(e=e, ids=ids, pos=pos, meta=meta):
            return e.model.compute_logits(e.runner.forward(ids, pos, meta)).float()

        fns.append(step)
    steps = timed_in_turn(fns, reps)
    first = run_case(next(iter(engines.values())), batch, context, 1, False, ["engine"])
    short = {torch.float32: "w:f32", torch.bfloat16: "w:bf16", torch.float16: "w:fp16"}
    names = [short[e.model.weight_dtype] for e in engines.values()]
    return {"attn_ms": first["attn_ms"], "steps_ms": {n: s * 1e3 for n, s in zip(names, steps)}}


def time_prefills(engines: dict, tokens: int, reps: int) -> dict[str, float]:
    """Best wall seconds of a ``tokens``-token prompt prefilled alone (one output token, prefix
    caching off), each engine in turn."""
    from engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    best: dict[str, float] = {}
    for _ in range(max(1, reps)):
        for e in engines.values():
            ids = torch.randint(100, e.model_config.vocab_size, (tokens,), generator=g).tolist()
            t0 = time.perf_counter()
            e.add_request(ids, params)
            while e.has_unfinished_requests():
                e.step()
            name = str(e.model.weight_dtype).removeprefix("torch.")
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    main()
