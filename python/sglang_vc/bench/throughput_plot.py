"""The PNG of ``bench.throughput``: throughput per configuration with its ratio to full KV
(end to end and decoding), the batch each achieved, and for staggered runs the verifies
per iteration. A row that is not valid (a retraction, or a wrong token against the
float32 reference) is hatched and labelled: its figure does not compare like with like."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["config"] for r in rows]
    traced = [r for r in rows if r.get("trace")]
    fig, axes = plt.subplots(1, 3 if traced else 2, figsize=(16 if traced else 11, 4.2))
    xs = list(range(len(rows)))
    decode_label = "decoding (" + (rows[0].get("decode_measure") or "decode phase") + ")"
    series = [("tokens_per_s", "ratio_to_full", "end to end", "tab:blue", -0.2),
              ("decode_tokens_per_s", "decode_ratio_to_full", decode_label, "tab:orange", 0.2)]
    for key, ratio, label, color, dx in series:
        bars = axes[0].bar([x + dx for x in xs], [r.get(key) or 0 for r in rows], width=0.4, color=color, label=label)
        for bar, r in zip(bars, rows):
            if r.get("valid") is False:
                bar.set_hatch("//")
                bar.set_edgecolor("tab:red")
            if r.get(ratio):
                axes[0].annotate(f"{r[ratio]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                 ha="center", va="bottom", fontsize=7)
    for x, r in zip(xs, rows):
        if r.get("valid") is False:
            axes[0].annotate("invalid: " + ", ".join(r.get("invalid_because") or []), (x, 0), ha="center",
                             va="bottom", fontsize=6, color="tab:red", rotation=90)
    axes[0].set_xticks(xs, names)
    axes[0].legend(fontsize=8)
    axes[0].set(ylabel="tokens/s", title="Throughput (ratio to full KV)")
    axes[1].bar(names, [r["mean_running"] for r in rows], color="tab:green", label="mean")
    axes[1].scatter(names, [r["max_running"] for r in rows], color="black", marker="_", s=300, label="max")
    axes[1].set(ylabel="running requests", title="Achieved batch size")
    axes[1].legend(fontsize=8)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=25, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    if traced:
        for r in traced:
            axes[2].plot(r["trace"]["verifies_per_iteration"], lw=0.8, label=f"{r['config']}: verifying")
            axes[2].plot(r["trace"]["drafting_per_iteration"], lw=0.8, ls=":", label=f"{r['config']}: drafting")
        axes[2].set(xlabel="decode iteration", ylabel="requests", title="Staggered: verifies per iteration")
        axes[2].legend(fontsize=7)
        axes[2].grid(alpha=0.3)
    s = report["settings"]
    fig.suptitle(f"{report['model']} on {report['device']}: {s['requests']} x {s['prompt_tokens']}-token "
                 f"prompts, {s['max_new_tokens']} new tokens, KV pool {s['max_total_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
