"""Synthetic chat workloads shared by the benchmarks: deterministic, chat-formatted prompts of
chosen token lengths, built from a fixed word list (no data set download)."""

from __future__ import annotations

import random

WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three cache memory token layer model "
    "scheduler request prefix block decode prefill transfer latency throughput cluster"
).split()


def chat_prompts(
    tokenizer, num: int, min_len: int, max_len: int, seed: int = 0, prefix: str = ""
) -> list[list[int]]:
    """``num`` chat-formatted prompts (token ids) of uniformly random total length in
    [min_len, max_len], each a user message of random words after an optional shared prefix."""
    rng = random.Random(seed)
    sentinel = "SENTINEL"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": sentinel}], add_generation_prompt=True
    )
    head_text, tail_text = rendered.split(sentinel)
    head = tokenizer.encode(head_text + prefix, add_special_tokens=False)
    tail = tokenizer.encode(tail_text, add_special_tokens=False)
    out = []
    for i in range(num):
        target = rng.randint(min_len, max_len)
        words = " ".join(rng.choice(WORDS) for _ in range(target))
        body = tokenizer.encode(f"Request {i}: {words}", add_special_tokens=False)
        out.append(head + body[: max(1, target - len(head) - len(tail))] + tail)
    return out
