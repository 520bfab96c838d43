"""Offline throughput: our engine against HF transformers on the same prompts, in one run.

    .venv/bin/python profiling/bench_offline.py          # 64 prompts, 100-600 tokens, 128 out
    .venv/bin/python profiling/bench_offline.py --num-prompts 16 --hf-single 4

Prints output tokens/s of: the engine (all prompts at once, continuous batching), transformers
`generate` one prompt at a time (on --hf-single prompts) and in padded batches, the ratios, and
batch-1 decode tokens/s with the achieved weight bandwidth (bytes of weights read per step).
Both run float32 on the same threads; speeds are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from engine.bench.machine import ceilings
from engine.bench.workload import chat_prompts
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step streams: every layer's weights (int8 ones where
    quantized) and the LM head's GEMM weight. The embedding table is not streamed (a step reads
    only its tokens' rows) unless it is the LM head (tied)."""

    def size(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    total = sum(size(p) for p in model.layers.parameters())
    for layer in model.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            total += size(lin.qweight) + size(lin.scales)
    total += size(model.norm.weight)
    if model.lm_qweight is not None:
        return total + size(model.lm_qweight) + size(model.lm_scales)
    return total + size(model.lm_head)


def bench_engine(llm: LLM, prompts, out_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt}


def bench_engine_batch1_decode(llm: LLM, prompt, out_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    m = out.metrics
    decode_s = m.last_token_time - m.first_token_time
    tok_s = (out_len - 1) / decode_s
    wb = weight_bytes(llm.engine.model)
    return {"decode_tok_s": tok_s, "weight_gb_s": tok_s * wb / 1e9, "weight_bytes": wb}


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_generate(model, batch: list[list[int]], out_len: int, pad_id: int) -> float:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=out_len,
        min_new_tokens=out_len,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=600)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-single", type=int, default=4, help="prompts for HF one-at-a-time")
    ap.add_argument("--hf-batch", type=int, default=16, help="HF padded batch size")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16"],
        help="engine dtype (transformers always runs float32, the reference)",
    )
    ap.add_argument("--quantization", default=None, choices=["int8"])
    ap.add_argument(
        "--batch1-only", action="store_true", help="only batch-1 decode against the GEMV floor"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    print(f"torch threads: {torch.get_num_threads()}  device: cpu  engine dtype: {args.dtype}")
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        quantization=args.quantization,
        cache=CacheConfig(kv_cache_memory_gb=6.0),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
    )
    llm = LLM.from_config(config)
    prompts = chat_prompts(llm.tokenizer, args.num_prompts, args.min_len, args.max_len)
    n_in = sum(len(p) for p in prompts)
    print(f"{len(prompts)} prompts, {n_in} prompt tokens, {args.output_len} output tokens each")

    # Warm up, then measure.
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    if args.batch1_only:
        args.skip_hf = True
        eng = {"tok_s": float("nan"), "seconds": float("nan")}
    else:
        eng = bench_engine(llm, prompts, args.output_len)
    b1 = bench_engine_batch1_decode(llm, prompts[0], args.output_len)
    ceil = ceilings()
    res = {"engine": eng, "engine_batch1": b1, "ceilings": ceil, "args": vars(args)}

    label = args.dtype + (f", {args.quantization}" if args.quantization else "")
    rows = [(f"engine (continuous batching, {label})", eng["tok_s"], eng["seconds"])]
    if not args.skip_hf:
        hf = load_hf(llm.engine.model_path)
        pad = llm.tokenizer.eos_token_ids[0]
        hf_generate(hf, [prompts[0][:32]], 4, pad)  # warm-up
        single = prompts[: args.hf_single]
        t_full = sum(hf_generate(hf, [p], args.output_len, pad) for p in single)
        t_first = sum(hf_generate(hf, [p], 1, pad) for p in single)
        hf_single_tok_s = len(single) * args.output_len / t_full
        hf_decode_tok_s = len(single) * (args.output_len - 1) / (t_full - t_first)
        t_batched = 0.0
        for i in range(0, len(prompts), args.hf_batch):
            t_batched += hf_generate(hf, prompts[i : i + args.hf_batch], args.output_len, pad)
        hf_batched_tok_s = len(prompts) * args.output_len / t_batched
        res["hf"] = {
            "single_tok_s": hf_single_tok_s,
            "single_decode_tok_s": hf_decode_tok_s,
            "batched_tok_s": hf_batched_tok_s,
            "batched_seconds": t_batched,
        }
        rows += [
            (f"transformers fp32 one at a time ({len(single)} prompts)", hf_single_tok_s, t_full),
            (f"transformers fp32 padded batches of {args.hf_batch}", hf_batched_tok_s, t_batched),
        ]

    print()
    print(f"{'system':48s} {'output tok/s':>12s} {'seconds':>9s}")
    for name, tps, secs in rows:
        print(f"{name:48s} {tps:12.1f} {secs:9.1f}")
    print()
    print(
        f"engine batch-1 decode: {b1['decode_tok_s']:.1f} tok/s, weights "
        f"{b1['weight_bytes'] / 1e6:.0f} MB -> {b1['weight_gb_s']:.2f} GB/s achieved"
    )
    tag = "torch.float32" if llm.engine.dtype == torch.float32 else "torch.bfloat16"
    gemv = ceil[f"gemv_gb_s_{tag}"]
    print(
        f"machine ceilings now: GEMV {ceil['gemv_gb_s_torch.float32']:.1f} GB/s fp32, "
        f"{ceil['gemv_gb_s_torch.bfloat16']:.1f} GB/s bf16; GEMM "
        f"{ceil['gemm_gflop_s_torch.float32']:.0f} GFLOP/s fp32, "
        f"{ceil['gemm_gflop_s_torch.bfloat16']:.0f} GFLOP/s bf16"
    )
    print(
        f"batch-1 decode floor for these weights: {b1['weight_bytes'] / 1e9 / gemv * 1e3:.1f} ms "
        f"= {gemv * 1e9 / b1['weight_bytes']:.1f} tok/s (engine reaches "
        f"{b1['weight_gb_s'] / gemv:.0%} of the GEMV bandwidth)"
    )
    if "hf" in res:
        hf = res["hf"]
        print(f"transformers batch-1 decode: {hf['single_decode_tok_s']:.1f} tok/s")
        print(
            f"ratio batch-1 decode, engine / transformers: "
            f"{b1['decode_tok_s'] / hf['single_decode_tok_s']:.2f}x"
        )
        print(
            f"ratio whole workload, engine / transformers one at a time: "
            f"{eng['tok_s'] / hf['single_tok_s']:.2f}x"
        )
        print(
            f"ratio whole workload, engine / transformers padded batches: "
            f"{eng['tok_s'] / hf['batched_tok_s']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
