"""The PNG plots of a comparison run (matplotlib Agg, the ``bench`` extra): tokens/s per system and dataset,
acceptance by draft position, tau across prompts."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.compare.systems import split_variant


def make_plots(result: dict, out_dir: Path) -> list:
    """PNG plots (matplotlib Agg); returns the file names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    st, summ, rows = result["settings"], result["summary"], result["rows"]
    systems, datasets = st["systems"], st["datasets"]
    names = []
    # 1. tokens/s per system per dataset (decode, and end to end)
    fig, axes = plt.subplots(2, 1, figsize=(max(10.0, 0.9 * len(datasets + ["all"]) * len(systems) / 3), 7),
                             sharey=True)
    w = 0.8 / max(1, len(systems))
    bases = list(dict.fromkeys(split_variant(v)[0] for v in systems))
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    groups = datasets + ["all"]
    for ax, key, title in zip(axes, ("tokens_per_second", "e2e_tokens_per_second"), ("decode", "end to end")):
        for i, s in enumerate(systems):
            vals = [(summ["by_dataset"].get(g, {}) if g != "all" else summ["all"]).get(s, {}).get(key) or 0
                    for g in groups]
            base, temp = split_variant(s)  # one colour per system; sampled variants hatched
            ax.bar([j + (i - (len(systems) - 1) / 2) * w for j in range(len(groups))], vals, w, label=s,
                   color=colors[bases.index(base) % len(colors)], hatch="///" if temp else None,
                   edgecolor="white" if temp else None, linewidth=0)
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_title(f"{title} tokens/s", fontsize=10)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{st['target_name']}, {st['max_new_tokens']} new tokens max", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "tokens_per_second.png", dpi=90)
    plt.close(fig)
    names.append("tokens_per_second.png")
    # 2. acceptance by draft position
    have = [s for s in systems if summ["all"].get(s, {}).get("acceptance_by_position")]
    if have:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        for s in have:
            acc = summ["all"][s]["acceptance_by_position"]
            base, temp = split_variant(s)
            ax.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc], marker="o", label=s,
                    color=colors[bases.index(base) % len(colors)], linestyle="--" if temp else "-")
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of rounds accepted")
        ax.set_ylim(0, 1)
        ax.set_title("acceptance by draft position (all prompts)", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "acceptance_by_position.png", dpi=90)
        plt.close(fig)
        names.append("acceptance_by_position.png")
    # 3. tau distribution over prompts
    taus = {s: [r["tau"] for r in rows if r["system"] == s and r.get("tau") is not None] for s in systems}
    taus = {s: v for s, v in taus.items() if v}
    if taus:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(taus)), 4.2))
        ax.boxplot(list(taus.values()), showmeans=True)
        ax.set_xticks(range(1, len(taus) + 1), list(taus), fontsize=8, rotation=30, ha="right")
        ax.set_ylabel("tau per prompt")
        ax.set_title("tau (tokens per verify round) across prompts", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "tau_distribution.png", dpi=90)
        plt.close(fig)
        names.append("tau_distribution.png")
    return names
