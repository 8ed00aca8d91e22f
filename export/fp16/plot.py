"""PNG plots for bundles: per-layer max |x| at each FP16-sensitive site against the FP16 limit."""
from __future__ import annotations

from pathlib import Path

from mbert.export.fp16.precision import FP16_MAX, LAYER_SITES, Plan, ScanReport


def plot_scan(report: ScanReport, plan: Plan, path: Path, title: str = "FP16 overflow scan") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    layers = sorted({s.layer for s in report.stats if s.layer is not None})
    for site in LAYER_SITES:
        ys = [report.get(i, site).max_abs for i in layers]
        ax.plot(layers, ys, marker="o", markersize=3, linewidth=1.2, label=site)
    ax.axhline(FP16_MAX, color="red", linewidth=2, label="FP16 max (65504)")
    ax.axhline(plan.limit, color="orange", linestyle="--", label=f"plan limit 65504/{plan.margin:g}")
    for layer in plan.fp32_layers():
        ax.axvspan(layer - 0.4, layer + 0.4, color="red", alpha=0.08)
    ax.set_yscale("log")
    ax.set_xlabel("layer (shaded: kept in FP32)")
    ax.set_ylabel("max |x| over calibration text")
    ax.set_title(f"{title}: {report.num_texts} texts, {report.num_tokens} tokens")
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
