"""What ``mbert-export`` prints: stage progress, and the summary of a finished export (files,
validation of every artifact, the FP16 scan per layer and the decisions of the plan, the INT8 plan
with its retrieval check and the blind quantizations beside it)."""
from __future__ import annotations

import click

from mbert.bundle.int8 import plan_table, summary_lines
from mbert.bundle.validation import ValidationReport
from mbert.runtime.cli.info import table

_KINDS = ("residual", "attention", "mlp")


def echo(event: str, message: str) -> None:
    if event == "stage":
        click.echo(click.style(message, bold=True) + " ...", err=True)
    elif event == "done":
        click.echo(f"    done in {message.split(': ')[-1]}", err=True)
    elif event == "started":
        click.echo("    running in the background", err=True)
    elif event == "background":
        click.echo(f"    {message.replace(': ', ' done in the background: ', 1)}", err=True)
    elif event == "progress":
        click.echo(f"    {message}", err=True)
    else:
        click.echo(message, err=True)


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def validation_rows(artifact: str, report: ValidationReport, verdicts: bool = True) -> list[tuple]:
    rows = []
    for name, err, cos, verdict, _case in report.table():
        rows.append((artifact, name, err, cos, verdict if verdicts else ("finite" if verdict != "NON-FINITE"
                                                                           else "NON-FINITE")))
    return rows


def summary(result) -> str:
    m = result.manifest
    parts = [f"\nBundle written: {result.bundle}"]
    files = sorted(m.files.items(), key=lambda kv: -kv[1].bytes)[:12]
    parts.append(table([(name, size(e.bytes)) for name, e in files], ("file (largest)", "size")))
    rows = [r for g in m.graphs for r in validation_rows(g.file, g.validation)]
    if m.precision is not None and m.precision.naive_fp16 is not None:
        rows += validation_rows("naive fp16 (reference only)", m.precision.naive_fp16, verdicts=False)
    if m.engine is not None and m.engine.validation is not None:
        rows += validation_rows(m.engine.file, m.engine.validation.report)
    if m.int8 is not None:
        rows += [(a, name, err, cos, f"would {verdict}") for b in m.int8.blind if b.validation is not None
                 for a, name, err, cos, verdict in validation_rows(f"blind int8, {b.name} (reference only)",
                                                                    b.validation)]
    parts.append("\nValidation against the eager FP32 model (worst over the real-text grid):")
    parts.append(table(rows, ("artifact", "output", "max abs err", "worst cosine", "verdict")))
    if result.fp16 is not None:
        parts.append("\nFP16 overflow scan, per layer (max |x| over calibration text; FP16 max 65504):")
        parts.append(table(per_layer(result.fp16.scan, result.fp16.plan),
                           ("layer", "max |x|", "at site", "headroom", "runs in")))
        decisions = m.precision.decisions
        parts.append("FP32 decisions: " + ("; ".join(decisions) if decisions
                                           else "none (every site fits FP16 with the margin)"))
        if m.precision.naive_fp16_tensorrt is not None:
            parts.append("naive fp16 on TensorRT (reference only): " + m.precision.naive_fp16_tensorrt.describe())
    if result.engine_note:
        parts.append("\n" + result.engine_note)
    if m.int8 is not None:
        headers, plan_rows = plan_table(m.int8)
        parts.append("\nINT8 sensitivity plan, per matrix (1 - cosine of each output when it alone runs INT8):")
        parts.append(table(plan_rows, headers))
        parts += summary_lines(m.int8)
    return "\n".join(parts)


def per_layer(scan, plan) -> list[tuple]:
    """One row per layer (and one for the model-level sites): its largest site and where it runs."""
    worst: dict = {}
    for s in scan.stats:
        if s.layer not in worst or s.max_abs > worst[s.layer].max_abs:
            worst[s.layer] = s
    rows = []
    for layer, s in worst.items():
        if layer is None:
            runs = "-"
        else:
            lp = plan.layers[layer]
            fp32 = [k for k in _KINDS if getattr(lp, k) == "float32"]
            runs = "FP32: " + ", ".join(fp32) if fp32 else "fp16"
        rows.append(("-" if layer is None else layer, f"{s.max_abs:.4g}", s.site, f"{s.headroom:.1f}x", runs))
    return rows
