"""``mbert-run``: embed text with a bundle, check its parity with the eager model, describe it.

Errors print one line (``error: ...``) and exit 1; ``--debug`` shows the traceback. Heavy modules
are imported inside the commands, so ``--help`` is instant.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from mbert.bundle.errors import TextFileError
from mbert.runtime.corpus import command as corpus_command

BACKEND_CHOICES = ["auto", "tensorrt", "onnxruntime", "onnxruntime-cuda", "onnxruntime-cpu", "eager"]


def _guard(fn):
    """Run a command; any error becomes one line and the exit code of ``mbert.bundle.errors.failure``
    (1 bad input or environment, 2 usage, 3 internal error; ``--debug``: the traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = (click.get_current_context().find_root().params or {}).get("debug")
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
            if debug:
                raise
            from mbert.bundle.errors import failure

            line, code = failure(exc)
            click.echo(line, err=True)
            sys.exit(code)

    return wrapper


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
    click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default=None,
                 help="ONNX Runtime graph to run (default: fp16 on CUDA when present, fp32 on CPU; int8: "
                 "model.int8.onnx on the CPU)."),
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
@click.option("--output", "output_file", type=click.Path(),  # a str: Path() would drop DIR/'s slash
              help="Write FILE.npy (float32 [N, D]) or FILE.jsonl (default: JSONL on stdout), or a corpus "
              "job's Parquet shards into DIR/ (a name ending with '/', or a folder).")
@_with(_backend_opts)
@click.option("--prompt-name", default=None, help="A prompt named in config_sentence_transformers.json.")
@click.option("--prompt", default=None, help="A literal prompt prepended to every text.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Texts per batch (default 32).")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=None,
              help="Padded tokens per batch (default 16384).")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalize (default: as the checkpoint declares).")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: only when stderr is a terminal).")
@_with(corpus_command.OPTIONS)
@_guard
def embed(bundle, texts, input_file, output_file, backend, device, precision, source, prompt_name, prompt,
          batch_size, max_batch_tokens, normalize, progress, **corpus):
    """Embed TEXT arguments, --input FILE, or lines on standard input; --output DIR/ streams a corpus
    (--input .txt, .jsonl or .parquet) into resumable Parquet shards, on Ray with --ray."""
    batching = {"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}
    if output_file is not None and corpus_command.is_folder(output_file):
        return corpus_command.run(bundle, texts, input_file, Path(output_file),
                                  lambda: _open(bundle, backend, device, precision, source, **batching),
                                  dict(backend=backend, device=device, precision=precision, max_batch_tokens=max_batch_tokens),
                                  dict(prompt=prompt, prompt_name=prompt_name, normalize=normalize,
                                       batch_size=batch_size), progress=progress, **corpus)
    corpus_command.check_options(output_file, **corpus)
    output_file = None if output_file is None else Path(output_file)
    items = [_argument_text(t, i) for i, t in enumerate(texts)]
    if input_file is not None:
        from mbert.bundle.texts import load_text_file

        items += load_text_file(input_file)
    if not items and not sys.stdin.isatty():
        items = _stdin_texts()
    if not items:
        raise click.UsageError("no input: give TEXT arguments, --input FILE, or lines on standard input")
    if output_file is not None:
        _check_output(output_file)
    enc = _open(bundle, backend, device, precision, source, **batching)
    vectors = enc.encode(items, normalize=normalize, batch_size=batch_size, prompt_name=prompt_name,
                         prompt=prompt, show_progress=sys.stderr.isatty() if progress is None else progress)
    stats = enc.last_stats
    if output_file is None:
        _write_jsonl(sys.stdout, vectors)
    else:
        _write_atomically(output_file, vectors)
    click.echo(f"embedded {stats.texts} texts ({stats.tokens} tokens, {stats.truncated} truncated to "
               f"{enc.max_length}) into [{vectors.shape[0]}, {vectors.shape[1]}] in {stats.total_s:.2f}s with "
               f"{enc.backend_name} ({enc.backend.artifact}, {enc.precision})"
               + (f" -> {output_file}" if output_file else ""), err=True)


def _argument_text(text: str, index: int) -> str:
    """A TEXT argument, from the bytes the command line passed (Python keeps bytes that are not
    UTF-8 as lone surrogates, which no tokenizer accepts)."""
    raw = os.fsencode(text)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TextFileError(f"TEXT argument {index + 1} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                            f"position {exc.start})") from None


def _stdin_texts() -> list[str]:
    """Non-blank lines of standard input, decoded as UTF-8 (the line of a bad byte is named), at most
    the text reader's limit in all (``/dev/zero`` is refused, not read until memory runs out)."""
    from mbert.bundle.files import TEXT_LIMIT

    texts, total, number = [], 0, 0
    while raw := sys.stdin.buffer.readline(TEXT_LIMIT - total + 1):
        number += 1
        total += len(raw)
        if total > TEXT_LIMIT:
            raise TextFileError(f"standard input: larger than the {TEXT_LIMIT >> 20} MiB this reader accepts")
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise TextFileError(f"standard input line {number}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} "
                                f"at position {exc.start})") from None
        if line.strip():
            texts.append(line)
    return texts


def _check_output(path: Path) -> None:
    """--output must end in .npy or .jsonl (any case) and its folder must exist; written as named."""
    if path.suffix.lower() not in (".npy", ".jsonl"):
        raise click.UsageError(f"--output {path}: expected a .npy or .jsonl file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise TextFileError(f"--output {path}: folder {parent} does not exist (create it first)")


def _write_jsonl(stream, vectors) -> None:
    import json

    for i, v in enumerate(vectors):
        stream.write(json.dumps({"index": i, "embedding": [float(x) for x in v]}) + "\n")


def _write_atomically(path: Path, vectors) -> None:
    """Write ``path`` exactly as named (np.save would add .npy to a name ending in .NPY), whole or not
    at all (a failure leaves no half-written output, and its message names ``path``)."""
    import numpy as np

    from mbert.bundle.files import atomic_write

    if path.suffix.lower() == ".npy":
        atomic_write(path, lambda f: np.save(f, vectors))
    else:
        atomic_write(path, lambda f: _write_jsonl(_Utf8(f), vectors))


class _Utf8:
    """A text ``write`` on a binary file."""

    def __init__(self, binary):
        self.binary = binary

    def write(self, text: str) -> None:
        self.binary.write(text.encode("utf-8"))


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
        from mbert.bundle.texts import load_text_file

        texts = load_text_file(input_file)
    enc = _open(bundle, backend, device, precision, source)
    report = enc.check_parity(texts, max_len=max_len)
    click.echo(f"parity of {report.artifact} against the eager FP32 model ({len(report.cases)} cases):")
    from mbert.runtime.cli.info import table

    click.echo(table(report.table(), ("output", "max abs err", "worst cosine", "verdict", "worst case")))
    for o in report.outputs:
        click.echo(f"  {o.name}: allowed {o.tolerance.describe()} ({o.tolerance.reason})")
    if json_file is not None:
        from mbert.bundle.schema import to_json

        json_file.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")
    report.raise_if_failed()
    click.echo("parity: pass")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--source", default=None, help="Source checkpoint for the eager backend.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the bundle's files.")
@_guard
def info(bundle, source, no_verify):
    """Manifest summary, precision plan, validation results, and the backends usable here."""
    from mbert.bundle import open_bundle
    from mbert.runtime.cli.info import describe

    click.echo(describe(open_bundle(bundle, verify=not no_verify), verified=not no_verify, source=source))


from mbert.runtime.cli.serve import serve as _serve  # noqa: E402 - click only: --help stays instant

main.add_command(_serve)

