"""What :mod:`.evicpress` reports from its measured rows: the fixed-compression frontier
and EvicPress's TTFT ratio at equal quality on it, each system's sustainable request rate
at a TTFT target, the per-context table that says where EvicPress loses, and the plots.

The frontier is every fixed config + LRU the knapsack could choose, LRU with full KV its
quality-1 end: the Pareto points (no other point as good in quality and faster), joined
by straight lines. EvicPress at quality q is compared with the frontier's TTFT at q.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .evicpress_stream import sustainable_rate


def _is_fixed(name: str) -> bool:
    return name.startswith("fixed:") or name == "lru"


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (quality, TTFT, name) points no other point beats in both, by quality."""
    best, out = float("inf"), []
    for q, t, n in sorted(points, key=lambda p: (-p[0], p[1])):
        if t < best:
            out.append((q, t, n))
            best = t
    return sorted(out)


def frontier_ttft(front: list[tuple[float, float, str]], quality: float) -> tuple[Optional[float], str]:
    """The frontier's TTFT at ``quality``: linear between the Pareto points around it;
    below the lowest, the fastest point's TTFT (no fixed config is faster); above the
    highest, None (no fixed config reaches it)."""
    if not front:
        return None, "none"
    if quality > front[-1][0] + 1e-9:
        return None, "above"
    if quality <= front[0][0]:
        return front[0][1], "below" if quality < front[0][0] - 1e-9 else "on"
    for (q0, t0, _), (q1, t1, _) in zip(front, front[1:]):
        if q0 <= quality <= q1:
            return (t0 if q1 == q0 else t0 + (t1 - t0) * (quality - q0) / (q1 - q0)), "interpolated"
    return front[-1][1], "on"


def frontier_at_rate(rows: list[dict]) -> dict:
    """For one arrival rate's rows: the frontier and each EvicPress point's TTFT ratio
    against it at its own quality (> 1: EvicPress is faster), and against LRU."""
    front = pareto([(r["quality"], r["ttft_mean_s"], r["system"]) for r in rows if _is_fixed(r["system"])])
    lru = next((r for r in rows if r["system"] == "lru"), None)
    out = {"frontier": [{"system": n, "quality": q, "ttft_mean_s": t} for q, t, n in front], "evicpress": {}}
    for r in rows:
        if not r["system"].startswith("evicpress"):
            continue
        at, how = frontier_ttft(front, r["quality"])
        out["evicpress"][r["system"]] = {
            "quality": r["quality"], "ttft_mean_s": r["ttft_mean_s"],
            "frontier_ttft_at_quality_s": at, "frontier_position": how,
            "ratio_vs_frontier": None if at is None else at / r["ttft_mean_s"],
            "ratio_vs_lru": None if lru is None else lru["ttft_mean_s"] / r["ttft_mean_s"],
            "quality_vs_lru": None if lru is None else r["quality"] - lru["quality"],
        }
    return out


def rates_summary(rows: list[dict], target_s: float) -> dict:
    """Each system's sustainable rate at the TTFT target, from its rows at every rate."""
    by_system: dict[str, list] = {}
    for r in rows:
        if r["ttft_mean_s"] is not None:
            by_system.setdefault(r["system"], []).append((r["rate_per_s"], r["ttft_mean_s"]))
    return {"ttft_target_s": target_s,
            "sustainable": {s: sustainable_rate(p, target_s) for s, p in by_system.items()}}


def context_table(contexts: list[dict], records: dict, profiles: dict, system: str,
                  served_by_config: dict) -> list[dict]:
    """Per context, under ``system`` (an EvicPress one): its requests, the configs and
    tiers that served them, the profiled and served quality of what its answers were
    served from, the TTFT it paid in the rate streams, and the same context's TTFT under
    full prefill and the quality each fixed config served it."""
    recs = [r for r in records.get(system, []) if "ttft_s" in r]
    full = [r for r in records.get("full-prefill", []) if "ttft_s" in r and r["rate_per_s"] is not None]
    out = []
    for c in contexts:
        timed = [r for r in recs if r["ctx"] == c["id"] and r["rate_per_s"] is not None]
        answers = [r for r in recs if r["ctx"] == c["id"] and "quality" in r]
        if not timed or not answers:
            continue
        prof = profiles.get(c["id"], {})
        prof_q = [prof.get(r["config"], 1.0 if r["config"] == "full" else None) for r in answers if r.get("config")]
        prof_q = [q for q in prof_q if q is not None]
        fp = [r["ttft_s"] for r in full if r["ctx"] == c["id"]]
        out.append({
            "ctx": c["id"], "source": c["source"], "tokens": len(c["token_ids"]), "requests": len(timed),
            "configs": sorted({r.get("config") or "recomputed" for r in timed + answers}),
            "tiers": sorted({r.get("tier", "none") for r in timed + answers}),
            "profiled_quality": sum(prof_q) / len(prof_q) if prof_q else None,
            "served_quality": sum(r["quality"] for r in answers) / len(answers),
            "ttft_mean_s": sum(r["ttft_s"] for r in timed) / len(timed),
            "full_prefill_ttft_s": sum(fp) / len(fp) if fp else None,
            "fixed_served_quality": {cfg: q[c["id"]] for cfg, q in served_by_config.items() if c["id"] in q},
        })
    return out


def loss_terms(table: list[dict], profile_seconds: float, requests: int) -> dict:
    """The terms that can lose EvicPress its lead, measured: the profiles' error on what was
    served, the profiling time per served request, and the share of requests a tier load
    or a recompute served."""
    err = [abs(r["profiled_quality"] - r["served_quality"]) for r in table if r["profiled_quality"] is not None]
    slow = sum(r["requests"] for r in table if set(r["tiers"]) & {"disk", "miss"})
    n = sum(r["requests"] for r in table) or 1
    return {"profile_error_mae": sum(err) / len(err) if err else None,
            "profile_seconds_per_request": profile_seconds / requests if requests else None,
            "requests_on_contexts_with_disk_or_miss": slow / n}


def served_by_config(records: dict) -> dict:
    """config -> context -> mean quality of a fixed system's answers (what each fixed
    config serves each context)."""
    out: dict = {}
    for name, recs in records.items():
        if not name.startswith("fixed:"):
            continue
        per: dict = {}
        for r in recs:
            if "quality" in r:
                per.setdefault(r["ctx"], []).append(r["quality"])
        out[name[len("fixed:"):]] = {k: sum(v) / len(v) for k, v in per.items()}
    return out


def plot(rows: list[dict], rates: dict, path: Path, title: Optional[str] = None) -> None:
    """TTFT vs quality per arrival rate (the fixed frontier as a line), and mean TTFT vs
    arrival rate per system with the TTFT target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rate = sorted({r["rate_per_s"] for r in rows})
    names = list(dict.fromkeys(r["system"] for r in rows))  # one color per system in every panel
    color = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(by_rate) + 1, figsize=(4.6 * (len(by_rate) + 1), 4.4), squeeze=False)
    for ax, rate in zip(axes[0], by_rate):
        rr = [r for r in rows if r["rate_per_s"] == rate and r["ttft_mean_s"] is not None]
        front = pareto([(r["quality"], r["ttft_mean_s"], r["system"]) for r in rr if _is_fixed(r["system"])])
        if front:
            ax.plot([t for _, t, _ in front], [q for q, _, _ in front], color="grey", lw=1, label="fixed frontier")
        for r in rr:
            name = r["system"]
            marker = "*" if name.startswith("evicpress") else ("s" if name == "lru" else ("^" if name.startswith("fixed") else "o"))
            ax.scatter(r["ttft_mean_s"], r["quality"], marker=marker, s=130 if marker == "*" else 50, label=name,
                       color=color[name])
        ax.set_title(f"{rate:.3g} requests/s", fontsize=10)
        ax.set_xlabel("mean TTFT (s)")
        ax.set_ylabel("quality (MiniLM cosine vs full prefill)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    for s in names:
        pts = sorted((r["rate_per_s"], r["ttft_mean_s"]) for r in rows if r["system"] == s and r["ttft_mean_s"] is not None)
        ax.plot(*zip(*pts), marker="o", label=s, color=color[s])
    ax.axhline(rates["ttft_target_s"], color="k", ls="--", lw=0.8, label="TTFT target")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("EvicPress vs the fixed-compression frontier (paper fig. 7)" + (f"\n{title}" if title else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profiles(profiles: dict, served: dict, path: Path) -> None:
    """Profiled against served quality, one point per (context, config), per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 4.2), squeeze=False)
    for ax, (method, per_ctx) in zip(axes[0], profiles.items()):
        for cfg, by_ctx in served.items():
            pts = [(q, per_ctx[cid][cfg]) for cid, q in by_ctx.items() if cfg in per_ctx.get(cid, {})]
            if pts:
                ax.scatter(*zip(*pts), s=25, label=cfg)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(method)
        ax.set_xlabel("served quality")
        ax.set_ylabel("profiled quality")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
