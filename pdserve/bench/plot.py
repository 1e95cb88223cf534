"""PNG of the run's latency CDFs (TTFT, ITL, e2e) with the SLOs drawn in. Uses matplotlib's
Agg canvas directly (no pyplot, no global backend switch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve.bench.client import RequestResult
from pdserve.bench.config import SloConfig


def plot_cdfs(results: list[RequestResult], slo: SloConfig, path: Path, title: str = "") -> None:
    done = [r for r in results if r.ok]
    panels = [
        ("TTFT", [r.ttft * 1e3 for r in done if r.ttft is not None], slo.ttft_ms),
        ("ITL (per chunk gap)", [g * 1e3 for r in done for g in r.itls], slo.itl_ms),
        ("end-to-end latency", [r.end * 1e3 for r in done if r.end is not None], None),
    ]
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (name, values, limit) in zip(fig.subplots(1, 3), panels):
        ax.set_title(f"{name} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if values:
            x = np.sort(np.asarray(values))
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(
                    np.percentile(x, q),
                    color="gray",
                    linestyle=style,
                    linewidth=1,
                    label=f"p{q} {np.percentile(x, q):.1f} ms",
                )
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        if limit is not None:
            ax.axvline(limit, color="red", linewidth=1.2, label=f"SLO {limit:g} ms")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
