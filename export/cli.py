"""``mbert-export``: checkpoint -> validated bundle (ONNX; with --fp16 also mixed precision, TensorRT, Triton).

Errors print one line and exit non-zero; ``--debug`` shows the traceback. Heavy modules are
imported only after the arguments parse, so ``--help`` is instant.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click


def _echo(event: str, message: str) -> None:
    if event == "stage":
        click.echo(click.style(message, bold=True) + " ...", err=True)
    elif event == "done":
        click.echo(f"    done in {message.split(': ')[-1]}", err=True)
    else:
        click.echo(message, err=True)


def _table(rows, headers) -> str:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _summary(result) -> str:
    m = result.manifest
    parts = [f"\nBundle written: {result.bundle}"]
    files = sorted(m["files"].items(), key=lambda kv: -kv[1]["bytes"])
    parts.append(_table([(name, _size(e["bytes"])) for name, e in files], ("file", "size")))
    rows = []
    for artifact, rep in m["validation"].items():
        for o in rep["outputs"]:
            rows.append((artifact, o["name"], f"{o['max_abs_error']:.2e}", f"{o['worst_cosine']:.7f}",
                         "pass" if o["passed"] else "FAIL"))
        naive = rep.get("naive_fp16")
        for o in (naive or {}).get("outputs", []):
            rows.append(("naive fp16 (reference only)", o["name"], f"{o['max_abs_error']:.2e}",
                         f"{o['worst_cosine']:.7f}", "finite" if o["finite"] else "NON-FINITE"))
    engine = m.get("engine") or {}
    for o in (engine.get("validation") or {}).get("outputs", []):
        rows.append(("model.plan", o["name"], f"{o['max_abs_error']:.2e}", f"{o['worst_cosine']:.7f}",
                     "pass" if o["passed"] else "FAIL"))
    parts.append("\nValidation against the eager FP32 model (worst over the real-text grid):")
    parts.append(_table(rows, ("artifact", "output", "max abs err", "worst cosine", "verdict")))
    if result.scan_rows:
        parts.append("\nFP16 overflow scan, per layer (max |x| over calibration text; FP16 max 65504):")
        parts.append(_table(_per_layer(result.scan_rows, result.plan), ("layer", "kind", "max |x|", "at site", "headroom", "runs in")))
        decisions = (m.get("precision") or {}).get("decisions") or []
        parts.append("FP32 decisions: " + ("; ".join(decisions) if decisions else "none (every site fits FP16 with the margin)"))
    if result.engine_note:
        parts.append("\n" + result.engine_note)
    return "\n".join(parts)


def _per_layer(scan_rows, plan: dict) -> list[tuple]:
    by_layer: dict[str, tuple] = {}
    for layer, site, mx, _pct, headroom, _verdict in scan_rows:
        if layer not in by_layer or float(mx) > float(by_layer[layer][0]):
            by_layer[layer] = (mx, site, headroom)
    rows = []
    every = {lp["layer"]: lp for lp in plan["layers"]}
    for layer, (mx, site, headroom) in by_layer.items():
        if layer == "-":
            rows.append(("-", "model", mx, site, headroom, "-"))
            continue
        lp = every[int(layer)]
        fp32 = [k for k in ("residual", "attention", "mlp") if lp[k] == "float32"]
        rows.append((layer, "", mx, site, headroom, "FP32: " + ", ".join(fp32) if fp32 else "fp16"))
    return rows


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model", required=False)
@click.option("--out", type=click.Path(path_type=Path), help="Bundle folder (default: engines/<model-name>).")
@click.option("--max-seq-len", type=int, help="Longest input the bundle accepts (default: the checkpoint's).")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18+: see mbert.export.onnx).")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@click.option("--task", type=click.Choice(["encoder", "masked-lm", "sequence-classification", "token-classification"]),
              help="Override the head chosen from config.json 'architectures' (encoder: hidden states only).")
@click.option("--fp16", is_flag=True, help="Also scan for FP16 overflow, write a mixed-precision ONNX, build a TensorRT engine.")
@click.option("--calibration", type=click.Path(path_type=Path), help="Your own text (one per line, or .jsonl) added to the built-in set.")
@click.option("--margin", type=float, default=8.0, show_default=True, help="Required FP16 headroom factor; sites above 65504/margin stay FP32.")
@click.option("--max-batch", type=int, default=32, show_default=True, help="Largest batch of the engine profiles and Triton.")
@click.option("--opt-batch", type=int, help="Batch TensorRT tunes for (default: max-batch/2).")
@click.option("--opt-seq-len", type=int, help="Sequence length TensorRT tunes for (default: 512).")
@click.option("--split-seq", help="Several engine profiles split at these lengths, e.g. 512,8192.")
@click.option("--workspace-gib", type=float, default=4.0, show_default=True, help="TensorRT builder workspace.")
@click.option("--no-engine", is_flag=True, help="With --fp16: skip the TensorRT engine.")
@click.option("--engine-only", "engine_only", type=click.Path(path_type=Path),
              help="Build the TensorRT engine for an existing --fp16 bundle (on a GPU machine), no re-export.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(model, out, max_seq_len, opset, overwrite, task, fp16, calibration, margin, max_batch, opt_batch,
         opt_seq_len, split_seq, workspace_gib, no_engine, engine_only, debug):
    """Export a ModernBERT-family checkpoint (hub id or local folder) to a validated bundle.

    \b
    mbert-export answerdotai/ModernBERT-base            # needs network (or the HF cache)
    mbert-export ./my-checkpoint --fp16 --max-seq-len 2048
    mbert-export --engine-only engines/my-checkpoint    # later, on a GPU machine
    """
    from mbert.modeling.errors import MbertError

    try:
        if engine_only is not None:
            from .engine_only import build_for_bundle

            note = build_for_bundle(engine_only, max_batch=max_batch, opt_batch=opt_batch, opt_seq_len=opt_seq_len,
                                    split_seq=_ints(split_seq), workspace_gib=workspace_gib, report=_echo)
            click.echo(note)
            return
        if not model:
            raise click.UsageError("MODEL is required (a hub id or a local checkpoint folder)")
        from .pipeline import ExportOptions, export_bundle

        options = ExportOptions(out=out, max_seq_len=max_seq_len, opset=opset, overwrite=overwrite, task=task,
                                fp16=fp16, calibration=calibration, margin=margin, max_batch=max_batch,
                                opt_batch=opt_batch, opt_seq_len=opt_seq_len, split_seq=_ints(split_seq),
                                workspace_gib=workspace_gib, engine=not no_engine)
        t0 = time.perf_counter()
        result = export_bundle(model, options, report=_echo)
        click.echo(_summary(result))
        click.echo(f"\nTotal {time.perf_counter() - t0:.1f}s")
    except click.UsageError:
        raise
    except KeyboardInterrupt:
        click.echo("interrupted: no bundle was written", err=True)
        sys.exit(130)
    except MbertError as exc:
        if debug:
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except Exception as exc:  # anything else is our bug: still one line unless --debug
        if debug:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        click.echo(f"internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)", err=True)
        sys.exit(2)


def _ints(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--split-seq")


if __name__ == "__main__":
    main()
