"""The INT8 plan's picture: each matrix's damage alone against the budget, and where it runs."""
from __future__ import annotations

from pathlib import Path


def plot_int8(matrices, budget: dict[str, float], calibration: str, path: Path, title: str = "INT8 sensitivity") -> None:
    """Per matrix (``mbert.bundle.int8.MatrixPlan``): how far quantizing it alone moves each output
    (1 - cosine) against the plan's budget; matrices kept FP32 are circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [m for m in matrices if m.damage]
    names = list(budget)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 3.2 * len(names)), dpi=110, squeeze=False)
    modules = list(dict.fromkeys(m.module for m in measured))
    last = max((m.layer for m in measured if m.layer is not None), default=0)
    for ax, out in zip(axes[:, 0], names):
        for module in modules:
            ms = [m for m in measured if m.module == module]
            xs = [m.layer if m.layer is not None else last + 1 for m in ms]
            ys = [max(m.damage[out], 1e-12) if m.damage[out] is not None else 1.0 for m in ms]
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=module)
            fp32 = [(x, y) for x, y, m in zip(xs, ys, ms) if m.precision != "int8"]
            if fp32:
                ax.scatter(*zip(*fp32), s=60, facecolors="none", edgecolors="red", zorder=3)
        ax.axhline(budget[out], color="orange", linestyle="--", label=f"plan budget {budget[out]:.1e}")
        ax.set_yscale("log")
        ax.set_ylabel(f"1 - cos {out}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="lower right")
    axes[-1, 0].set_xlabel(f"layer (head at {last + 1}); red circles: kept FP32")
    axes[0, 0].set_title(f"{title}: each matrix quantized alone; {calibration}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
