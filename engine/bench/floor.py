"""The least time a prefill workload can take on a CPU: its multiply-accumulates, counted from the
model's shapes and the prefix cache's reuse, over a product rate measured in the same run.

A request one at a time computes the tokens past its cached prefix: every projection once per
token (q, k, v, o, the MLP's three and, for the first output token, the LM head's row), and for
each new token at position t the attention's two products over its t + 1 keys (scores and
values) in every query head. The prefix cache keeps whole blocks: a prompt reuses the longest
prefix it shares with an earlier prompt, rounded down to the block size, and its last token is
always computed. Dividing the total by a rate gives a floor: no engine computing the same
products exactly gets under it at that rate, whatever it does about softmax, norms or memory.
bench_peer.py prints it beside the trace workload (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import ModelConfig


def token_macs(cfg: ModelConfig) -> int:
    """Multiply-accumulates of one token's projections in one layer."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    return attn + 3 * h * cfg.intermediate_size


def prefill_macs(cfg: ModelConfig, start: int, end: int) -> int:
    """Multiply-accumulates of prefilling positions [start, end) over a cached [0, start), the
    first output token's LM head row included."""
    if not 0 <= start < end:
        raise ValueError(f"prefill needs 0 <= start < end, got start={start}, end={end}")
    n = end - start
    keys = (start + 1 + end) * n // 2  # sum of t + 1 over t in [start, end)
    per_layer = n * token_macs(cfg) + 2 * cfg.num_heads * cfg.head_dim * keys
    return cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size


def cached_prefix(prompt: Sequence[int], earlier: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens of ``prompt`` a whole-block prefix cache holding ``earlier`` serves: the longest
    shared prefix in whole blocks, at most all but the last token's block."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    best = 0
    for e in earlier:
        n = 0
        for a, b in zip(prompt, e):
            if a != b:
                break
            n += 1
        best = max(best, n)
    best = min(best, len(prompt) - 1)
    return best // block_size * block_size


def workload_macs(cfg: ModelConfig, prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Each prompt's prefill multiply-accumulates, sent one at a time in order, each reusing what
    the ones before it left in the prefix cache (nothing evicted)."""
    out = []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
        out.append(prefill_macs(cfg, cached_prefix(p, prompts[:i], block_size), len(p)))
    return out


def floor_line(
    macs: Sequence[int], rate_gmac_s: float, what: str, peer_ttft_s: float | None
) -> str:
    """One line for a benchmark's output: the workload's total and its mean TTFT floor at the
    rate, as a ratio of a peer's measured mean TTFT when one ran."""
    if not rate_gmac_s > 0:
        raise ValueError(f"rate_gmac_s must be > 0, got {rate_gmac_s}")
    mean = sum(macs) / len(macs) / (rate_gmac_s * 1e9)
    line = (
        f"floor: {sum(macs) / 1e12:.2f} T multiply-adds ({len(macs)} "
        f"request{'s' if len(macs) != 1 else ''}, prefix cache "
        f"reuse counted) at {what} ({rate_gmac_s:.0f} GMAC/s): mean TTFT >= {mean:.2f} s"
    )
    if peer_ttft_s:
        line += f", {mean / peer_ttft_s:.2f}x llama-server's {peer_ttft_s:.2f} s"
    return line
