"""Shared plotting for the benchmarks (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["plot_lines"]


def plot_lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: str | Path,
    *,
    markers: bool = False,
    logy: bool = False,
    reference: tuple[str, Sequence[float], Sequence[float]] | None = None,
    note: str | None = None,
) -> str:
    """One line per entry of ``series`` (label -> (xs, ys)); write a PNG to ``path``.

    ``None`` values in ``ys`` are skipped. ``reference``: an extra dashed grey line
    ``(label, xs, ys)`` (e.g. the ideal ``x + 1``). ``note``: small text under the axes.
    Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    style = {"marker": "o", "markersize": 3.5} if markers else {}
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, linewidth=1.6, **style)
    if reference is not None:
        rlabel, rxs, rys = reference
        ax.plot(list(rxs), list(rys), linestyle="--", color="grey", linewidth=1.2, label=rlabel)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series or reference:
        ax.legend(fontsize=8, ncol=2 if len(series) > 5 else 1)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="dimgrey", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
    else:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)
