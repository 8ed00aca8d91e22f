"""``mbert-run``: embed text with a bundle, check its parity with the eager model, describe it.

Errors print one line (``error: ...``) and exit 1; ``--debug`` shows the traceback. Heavy modules
are imported inside the commands, so ``--help`` is instant.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

BACKEND_CHOICES = ["auto", "tensorrt", "onnxruntime", "onnxruntime-cuda", "onnxruntime-cpu", "eager"]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _guard(fn):
    """Run a command; any error becomes ``error: <one line>`` and exit status 1 (``--debug``: traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = (click.get_current_context().find_root().params or {}).get("debug")
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
            if debug:
                raise
            click.echo(f"error: {_one_line(exc)}", err=True)
            sys.exit(1)

    return wrapper


def _table(rows, headers) -> str:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _open(bundle, backend, device, precision, source, **kwargs):
    import logging

    from mbert.runtime.encoder import Encoder

    logging.getLogger("mbert.runtime").setLevel(logging.WARNING)
    return Encoder.from_bundle(bundle, backend=backend, device=device, precision=precision, source=source, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
def main(debug: bool) -> None:
    """Run exported ModernBERT bundles: embed text, check parity with the eager model, describe a bundle."""


_backend_opts = [
    click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True,
                 help="auto: TensorRT, then ONNX Runtime CUDA, then ONNX Runtime CPU."),
    click.option("--device", default=None, help="cpu, cuda or cuda:N (default: best available)."),
    click.option("--precision", type=click.Choice(["fp32", "fp16"]), default=None,
                 help="ONNX Runtime graph to run (default: fp16 on CUDA when present, fp32 on CPU)."),
    click.option("--source", default=None, help="Source checkpoint for the eager backend / parity reference "
                 "(default: the path or hub id the manifest records)."),
]


def _with(opts):
    def deco(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn
    return deco


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("texts", nargs=-1)
@click.option("--input", "input_file", type=click.Path(path_type=Path), help="Text file: one text per line, "
              "or .jsonl with strings / {\"text\": ...} objects.")
@click.option("--output", "output_file", type=click.Path(path_type=Path),
              help="Write FILE.npy (float32 [N, D]) or FILE.jsonl; default: JSONL on stdout.")
@_with(_backend_opts)
@click.option("--prompt-name", default=None, help="A prompt named in config_sentence_transformers.json.")
@click.option("--prompt", default=None, help="A literal prompt prepended to every text.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Texts per batch (default 32).")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=None,
              help="Padded tokens per batch (default 16384).")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalize (default: as the checkpoint declares).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@_guard
def embed(bundle, texts, input_file, output_file, backend, device, precision, source, prompt_name, prompt,
          batch_size, max_batch_tokens, normalize, progress):
    """Embed TEXT arguments, --input FILE, or lines on standard input."""
    import json

    import numpy as np

    items = list(texts)
    if input_file is not None:
        from mbert.export.texts import load_text_file

        items += load_text_file(input_file)
    if not items and not sys.stdin.isatty():
        items = [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    if not items:
        raise click.UsageError("no input: give TEXT arguments, --input FILE, or lines on standard input")
    if output_file is not None and output_file.suffix.lower() not in (".npy", ".jsonl"):
        raise click.UsageError(f"--output {output_file}: expected a .npy or .jsonl file name")
    enc = _open(bundle, backend, device, precision, source,
                **({"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}))
    vectors = enc.encode(items, normalize=normalize, batch_size=batch_size, prompt_name=prompt_name,
                         prompt=prompt, show_progress=progress)
    stats = enc.last_stats
    if output_file is not None and output_file.suffix.lower() == ".npy":
        output_file.parent.mkdir(parents=True, exist_ok=True)
        np.save(output_file, vectors)
    else:
        stream = open(output_file, "w", encoding="utf-8") if output_file is not None else sys.stdout
        try:
            for i, v in enumerate(vectors):
                stream.write(json.dumps({"index": i, "embedding": [float(x) for x in v]}) + "\n")
        finally:
            if output_file is not None:
                stream.close()
    click.echo(f"embedded {stats.texts} texts ({stats.tokens} tokens, {stats.truncated} truncated to "
               f"{enc.max_length}) into [{vectors.shape[0]}, {vectors.shape[1]}] in {stats.total_s:.2f}s with "
               f"{enc.backend_name} ({enc.backend.artifact}, {enc.precision})"
               + (f" -> {output_file}" if output_file else ""), err=True)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@_with(_backend_opts)
@click.option("--input", "input_file", type=click.Path(path_type=Path), help="Texts to build cases from "
              "(default: the built-in set).")
@click.option("--max-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Longest case, in tokens.")
@click.option("--json", "json_file", type=click.Path(path_type=Path), help="Also write the report as JSON.")
@_guard
def parity(bundle, backend, device, precision, source, input_file, max_len, json_file):
    """Compare the bundle's backend with the eager PyTorch model on real text."""
    import json

    texts = None
    if input_file is not None:
        from mbert.export.texts import load_text_file

        texts = load_text_file(input_file)
    enc = _open(bundle, backend, device, precision, source)
    report = enc.check_parity(texts, max_len=max_len)
    click.echo(f"parity of {report.artifact} against the eager FP32 model ({len(report.cases)} cases):")
    click.echo(_table(report.table(), ("output", "max abs err", "worst cosine", "verdict", "worst case")))
    for o in report.outputs:
        click.echo(f"  {o.name}: tolerance atol {o.tolerance.atol:g}, cosine >= {o.tolerance.min_cosine} "
                   f"({o.tolerance.reason})")
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    report.raise_if_failed()
    click.echo("parity: pass")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--source", default=None, help="Source checkpoint for the eager backend.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the bundle's files.")
@_guard
def info(bundle, source, no_verify):
    """Manifest summary, precision plan, validation results, and the backends usable here."""
    from mbert.runtime import backends, checks

    m = checks.open_manifest(bundle, verify=not no_verify)
    model, src = m.get("model") or {}, m.get("source") or {}
    pooling = m.get("pooling")
    out = [f"bundle      {bundle} ({'files verified' if not no_verify else 'hashes NOT verified'}, "
           f"format {m.get('format_version')})",
           f"name        {m.get('name')}   task {m.get('task')}   created {m.get('created', '?')}",
           f"source      {src.get('id') or src.get('path')}" + (f"@{src['revision']}" if src.get("revision") else ""),
           f"model       hidden {model.get('hidden_size')}, {model.get('num_hidden_layers')} layers, "
           f"local attention {model.get('local_attention')}, vocab {model.get('vocab_size')}",
           f"max length  {m.get('max_seq_len')} tokens (graph); opset {m.get('opset')}",
           "outputs     " + ", ".join(f"{o['name']} {o['shape']}" for o in m["io"]["outputs"])]
    if pooling:
        prompts = ", ".join(f"{k}={v!r}" for k, v in pooling.get("prompts", {}).items()) or "none"
        out.append(f"pooling     {'+'.join(pooling['modes'])}, normalize {pooling['normalize']}, max_seq_length "
                   f"{pooling.get('max_seq_length')}, include_prompt {pooling.get('include_prompt')}; prompts: "
                   f"{prompts} (default {pooling.get('default_prompt_name')})")
    if m.get("labels"):
        out.append("labels      " + ", ".join(f"{k}={v}" for k, v in m["labels"].items()))
    files = m.get("files") or {}
    out.append("artifacts   " + ", ".join(
        f"{kind}: {name}" + (f" ({files[name]['bytes'] / 2**20:.1f} MB)" if name in files else "")
        for kind, name in (m.get("artifacts") or {}).items()))
    tv = m.get("tool_versions") or {}
    out.append("built with  " + ", ".join(f"{k} {v}" for k, v in tv.items()))
    prec = m.get("precision")
    if prec:
        out.append(f"\nFP16 precision plan (margin {prec.get('margin')}x, max |x| seen {prec.get('max_abs_seen', 0):.4g}; "
                   f"FP16 max 65504): FP32 layers {prec.get('fp32_layers') or 'none'}")
        for d in prec.get("decisions") or []:
            out.append(f"  {d}")
    rows = []
    for artifact, rep in (m.get("validation") or {}).items():
        for o in rep.get("outputs", []):
            rows.append((artifact, o["name"], f"{o['max_abs_error']:.2e}", f"{o['worst_cosine']:.7f}",
                         "pass" if o["passed"] else "FAIL", o.get("worst_case", "")))
    engine = m.get("engine") or {}
    for o in (engine.get("validation") or {}).get("outputs", []):
        rows.append(("model.plan", o["name"], f"{o['max_abs_error']:.2e}", f"{o['worst_cosine']:.7f}",
                     "pass" if o["passed"] else "FAIL", o.get("worst_case", "")))
    if rows:
        out.append("\nValidation at export (against the eager FP32 model):")
        out.append(_table(rows, ("artifact", "output", "max abs err", "worst cosine", "verdict", "worst case")))
    if engine:
        out.append(f"\nTensorRT engine: TensorRT {engine.get('tensorrt_version')}, {engine.get('gpu_name')} "
                   f"(compute capability {engine.get('compute_capability')}), profiles "
                   + "; ".join(f"min {p['min']} opt {p['opt']} max {p['max']}" for p in engine.get("profiles") or []))
    out.append("\nBackends on this machine:")
    statuses = backends.backend_statuses(Path(bundle), m, source)
    out.append(_table([(s.name, "yes" if s.usable else "no", s.reason) for s in statuses],
                      ("backend", "usable", "detail")))
    usable = [s.name for s in statuses if s.usable and s.name != "eager"]
    out.append(f"auto picks: {usable[0] if usable else 'nothing (install onnxruntime)'}")
    click.echo("\n".join(out))


if __name__ == "__main__":  # pragma: no cover
    main()
