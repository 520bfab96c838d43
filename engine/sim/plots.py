"""The plots of docs/reproduction.md (under docs/figures/), from the results of the experiments
of engine/sim/experiments.py, each beside the paper's figure where it has one."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from engine.sim.experiments import (  # noqa: E402
    INF,
    PAPER_FIG1,
    PAPER_FIG5,
    PAPER_TABLE1,
    PLOTTED_SETUP,
    SHARE,
    setup_name,
)


def plot_policies(res: dict, path: Path) -> None:
    names = ["random", "load", "cache_aware", "kvcentric"]
    ours = [res["policies"][n]["ttft_mean_s"] for n in names]
    paper = [PAPER_FIG5[n] for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], paper, 0.4, label="paper (FAST'25 Fig. 5)", color="#bbbbbb")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="ours (simulated)", color="#1f77b4")
    for i, (p, o) in enumerate(zip(paper, ours)):
        ax.text(i - 0.2, p, f"{p:.2f}", ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, o, f"{o:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), ["random", "load balancing", "local cache-aware", "KVCache-centric"])
    ax.set_ylabel("average TTFT (s)")
    ax.set_title("Conversation trace, 8 prefill + 8 decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rejection(res: dict, path: Path) -> None:
    res = res[PLOTTED_SETUP]
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.0), sharex=True)
    for ax, rej in zip(axes, ("none", "early", "predicted")):
        tl = res[rej]["timeline"]
        t = [row[0] / 60 for row in tl]
        ax.plot(t, [row[1] for row in tl], label="prefill load (queue / TTFT SLO)", lw=1)
        ax.plot(t, [row[2] for row in tl], label="decode load (KV used or TBT / SLO)", lw=1)
        ax.axhline(1.0, color="grey", lw=0.5, ls="--")
        ax.set_ylabel("load")
        ax.set_title(
            f"{setup_name(PLOTTED_SETUP)}, rejection = {rej}: {res[rej]['rejected']} rejected "
            f"({res[rej]['rejected_after_prefill']} after their prefill)",
            fontsize=9,
        )
        ax.set_ylim(0, 1.6)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("replay time (min)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_colocated(res: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), sharey=True)
    for ax, tbt in zip(axes, PAPER_FIG1):
        for mode, style in (("disaggregated", "-o"), ("colocated", "-s")):
            pts = sorted(res[mode].items())
            ax.plot([s for s, _ in pts], [v["share"][tbt] for _, v in pts], style, label=mode, ms=3)
        ax.axhline(SHARE, color="grey", lw=0.5, ls="--")
        ax.set_title(f"TTFT <= 30 s, TBT <= {tbt * 1000:.0f} ms", fontsize=9)
        ax.set_xlabel("replay speed")
    axes[0].set_ylabel("share of requests meeting both SLOs")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rate(res: dict, path: Path) -> None:
    caps = [c for c in PAPER_TABLE1 if c != INF]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for j, (policy, color) in enumerate((("lru", "C0"), ("lfu", "C1"), ("length", "C2"))):
        ax.plot(
            caps, [res[(c, policy)] for c in caps], "-o", color=color, ms=3, label=f"ours {policy}"
        )
        ax.plot(
            caps,
            [PAPER_TABLE1[c][j] for c in caps],
            "--",
            color=color,
            lw=0.8,
            label=f"paper {policy} (own trace)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (512-token blocks)")
    ax.set_ylabel("prompt tokens hit")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
