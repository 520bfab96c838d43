"""The priority benchmark's workload and figures (no server), and one tiny run of the whole
benchmark against two real servers on a tiny model (slow)."""

from __future__ import annotations

import json

import pytest

from engine.bench.priority import (
    HIGH,
    LOW,
    Sample,
    body,
    chat_requests,
    main,
    ratios,
    summarize,
)


def test_chat_requests_spread_the_high_ones_and_their_lengths():
    reqs = chat_requests(40, 12, 0.25, seed=3, max_tokens=32, spread=0.75)
    assert [i for i, r in enumerate(reqs) if r.high] == list(range(0, 40, 4))
    again = chat_requests(40, 12, 0.25, 3, 32, 0.75)  # the same for both policies
    assert [(r.messages, r.max_tokens) for r in reqs] == [(r.messages, r.max_tokens) for r in again]
    assert all(len(r.messages[0]["content"].split()) == 12 + 2 for r in reqs)
    lengths = {r.max_tokens for r in reqs}
    assert min(lengths) >= 8 and max(lengths) <= 56 and len(lengths) > 10
    assert {r.max_tokens for r in chat_requests(5, 3, 0.5, 0, 16)} == {16}
    with pytest.raises(ValueError, match="high_share"):
        chat_requests(4, 4, 0.0, 0)
    with pytest.raises(ValueError, match="spread"):
        chat_requests(4, 4, 0.5, 0, 16, 1.0)


def test_only_the_priority_run_sends_a_priority():
    req = chat_requests(2, 3, 0.5, 0, 8)
    assert "priority" not in body(req[0], "m", "fcfs")
    assert body(req[0], "m", "priority")["priority"] == HIGH
    assert body(req[1], "m", "priority")["priority"] == LOW
    assert body(req[1], "m", "priority")["stream"] is True
    assert body(req[1], "m", "fcfs")["max_tokens"] == 8


def test_summary_per_class_and_the_ratio_of_the_p90s():
    samples = [Sample(False, ttft=99.0, e2el=99.0, output_tokens=8) for _ in range(2)]  # skipped
    samples += [Sample(True, ttft=t / 1e3, e2el=1.0, output_tokens=4) for t in range(1, 11)]
    samples += [Sample(False, ttft=2.0, e2el=3.0, output_tokens=4) for _ in range(10)]
    s = summarize(samples, seconds=8.0, skip=2)
    assert s["output_tok_s"] == 12.0  # every request's tokens
    assert s["high"]["requests"] == 10 and s["high"]["ttft_p90_ms"] == pytest.approx(9.1)
    assert s["low"]["ttft_p50_ms"] == pytest.approx(2000.0)

    def run(policy, r, high, low):
        return {"policy": policy, "round": r, "high": {"ttft_p90_ms": high},
                "low": {"ttft_p90_ms": low}}  # fmt: skip

    runs = [run("fcfs", 0, 100, 100), run("priority", 0, 20, 130)]
    runs += [run("priority", 1, 60, 100), run("fcfs", 1, 200, 100)]
    rel = ratios(runs)
    assert rel["high_rounds"] == [0.2, 0.3] and rel["high"] == pytest.approx(0.25)
    assert rel["low_rounds"] == [1.3, 1.0] and rel["low"] == pytest.approx(1.15)
    with pytest.raises(RuntimeError, match="1 request"):
        summarize([Sample(True, error="HTTP 400")], 1.0)


@pytest.mark.slow
def test_a_tiny_run_against_both_policies(tmp_path, capsys):
    from tiny_models import tiny_model

    out = tmp_path / "priority.json"
    argv = ["--num-requests", "12", "--max-tokens", "3", "--prompt-words", "8",
            "--max-num-seqs", "2", "--high-share", "0.25", "--model", str(tiny_model("llama")),
            "--dtype", "float32", "--kv-cache-memory-gb", "0.05"]  # fmt: skip
    argv += ["--save-result", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # 12 requests, every 4th high, the first 4 (the clients' first, sent at once) not counted
    assert "| priority | high | 2 |" in text and "| fcfs | low | 6 |" in text
    assert "high-priority TTFT p90, priority / fcfs" in text and "CPU: " in text
    saved = json.loads(out.read_text())
    assert [r["policy"] for r in saved["runs"]] == ["fcfs", "priority"]
    assert all(r["clients"] == 4 for r in saved["runs"])
