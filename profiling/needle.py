"""Needle in a haystack: does the model still find a fact in a long prompt, at each length and
depth, with the model's own positions, with a rotary scaling that stretches them
(``--rope-scaling``), or plainly past them (``--max-model-len`` alone)?

    .venv/bin/python profiling/needle.py --lengths 4096 8192 16384 --depths 0.5
    .venv/bin/python profiling/needle.py --lengths 16384 32768 --modes yarn

A passphrase sentence is put at the given depth of a haystack of filler sentences, the prompt
ends in "Answer: The secret passphrase is", and the greedy answer (16 tokens) is a hit when it
contains the passphrase. Modes: ``own`` (the model's rotary; lengths past its context served
with the engine's warning), ``yarn`` (YaRN with factor = the longest length / the model's
context, at least 1), ``dynamic`` (NTK-aware, same factor). Prints a table: hits and time to
the answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
WORDS = ["orchid", "copper", "lantern", "meadow", "harbor", "violet", "saddle", "quartz"]


def haystack_ids(tok, length: int, depth: float, word: str) -> list[int]:
    """About ``length`` tokens of filler with the needle at ``depth``, ending in the sentence the
    answer completes (a completion, not a chat turn: a 135M model follows it better)."""
    needle = f" The secret passphrase is {word}. Remember it. "
    filler = tok.encode(FILLER, add_special_tokens=False)
    body = (filler * (length // len(filler) + 1))[: max(0, length - 40)]
    at = int(len(body) * depth)
    text = tok.decode(body[:at]) + needle + tok.decode(body[at:])
    return tok.encode(text + "\n\nQuestion: what is the secret passphrase?\nAnswer: The secret "
                      "passphrase is")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--modes", nargs="+", default=["own", "yarn"],
                    choices=["own", "yarn", "dynamic"])  # fmt: skip
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from engine.cpu_isa import this_cpu
    from engine.model.loader import open_checkpoint

    print(this_cpu().describe(), flush=True)
    context = open_checkpoint(args.model)[1].config.max_position_embeddings
    longest = max(args.lengths) + 256
    factor = max(1.0, math.ceil(longest / context))
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    rows = []
    for mode in args.modes:
        rope = None
        if mode != "own":
            rope = json.dumps({"rope_type": mode, "factor": factor,
                               "original_max_position_embeddings": context})  # fmt: skip
        llm = LLM(args.model, max_model_len=max(longest, context), rope_scaling=rope,
                  enable_prefix_caching=False)  # fmt: skip
        tok = llm.engine.tokenizer
        for length in args.lengths:
            for i, depth in enumerate(args.depths):
                word = WORDS[(i + length) % len(WORDS)]
                ids = haystack_ids(tok, length, depth, word)
                t = time.perf_counter()
                text = llm.generate([ids], sp)[0].outputs[0].text
                took = time.perf_counter() - t
                hit = word in text.lower()
                rows.append(dict(mode=mode, length=len(ids), depth=depth, hit=hit, seconds=took,
                                 answer=text.strip()[:40]))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        llm.close()
    print(f"\nmodel {args.model}, context {context}; yarn/dynamic factor {factor:g}")
    print("| mode | prompt tokens | depth | found | answer | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['length']} | {r['depth']} | {'yes' if r['hit'] else 'no'} "
              f"| {r['answer']!r} | {r['seconds']:.1f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
