"""``mbert-run embed ... --output DIR/``: the corpus job's options and its dispatch from the embed command
(imports only click until a job runs, so ``--help`` stays instant)."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import click

GPU_BACKENDS = ("tensorrt", "onnxruntime-cuda")  # --ray: each actor reserves one GPU
OPTIONS = [
    click.option("--window", type=click.IntRange(min=1), default=None,
                 help="Corpus job (--output DIR/): texts in memory at once, and rows per shard (default 4096)."),
    click.option("--text-column", default="text", show_default=True,
                 help="Corpus job: the text column of a .parquet input (the key of .jsonl objects)."),
    click.option("--id-column", default=None,
                 help="Corpus job: the id column / key (default: 'id' where present, else the row or line index)."),
    click.option("--overwrite", is_flag=True, help="Corpus job: start again in an output folder that holds a job."),
    click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
                 help="Corpus job on the Ray cluster at ADDRESS ('auto': the usual discovery); needs [ray]."),
    click.option("--actors", type=click.IntRange(min=1), default=1, show_default=True,
                 help="--ray: encoder actors (one per GPU with --backend tensorrt)."),
    click.option("--threads-per-actor", type=click.IntRange(min=1), default=1, show_default=True,
                 help="--ray: CPUs each actor reserves and its ONNX Runtime intra-op threads."),
]


def is_folder(output: str) -> bool:
    """``--output`` names a corpus job's folder: a name ending with '/', or an existing folder."""
    return output.endswith(("/", os.sep)) or Path(output).is_dir()


def check_options(output, window, ray_address, overwrite, **_) -> None:
    """Corpus-only options given without ``--output DIR/``: a usage error naming them."""
    given = [name for name, value in (("--window", window), ("--ray", ray_address), ("--overwrite", overwrite)) if value]
    if given:
        raise click.UsageError(f"{', '.join(given)}: only for a corpus job (--input FILE --output DIR/), "
                               f"not --output {output or 'on standard output'}")


def run(bundle, texts, input_file, output, open_encoder, backend_options: dict, encode_options: dict, *, progress,
        window, text_column, id_column, overwrite, ray_address, actors, threads_per_actor) -> None:
    """Run the corpus job and print one summary line: in this process (``open_encoder()`` opens the
    Encoder with the command's options) or on Ray (each actor opens it with ``backend_options``)."""
    from mbert.runtime.corpus.job import DEFAULT_WINDOW

    if texts or input_file is None:
        raise click.UsageError("a corpus job (--output DIR/) reads --input FILE (.txt, .jsonl or .parquet), "
                               "not TEXT arguments or standard input")
    window = window or DEFAULT_WINDOW
    show = sys.stderr.isatty() if progress is None else progress
    common = dict(window=window, text_column=text_column, id_column=id_column, overwrite=overwrite, progress=show,
                  **encode_options)
    if ray_address is not None:
        from mbert.runtime.corpus.ray import run_ray

        gpus = 1 if backend_options["backend"] in GPU_BACKENDS else 0  # one GPU per actor: Ray assigns it
        summary = run_ray(ray_address, bundle, input_file, output, actors=actors, threads_per_actor=threads_per_actor,
                          num_gpus_per_actor=gpus, **backend_options, **common)
        how = f"on Ray ({ray_address}, {actors} actors x {threads_per_actor} threads)"
    else:
        from mbert.runtime.corpus.job import embed_corpus

        enc = open_encoder()
        with warnings.catch_warnings():  # the summary counts truncated texts; each row's flag names them
            warnings.filterwarnings("ignore", message=r".* inputs are longer than .* tokens and were truncated")
            summary = embed_corpus(enc, input_file, output, **common)
        how = f"with {enc.backend_name} ({enc.backend.artifact}, {enc.precision})"
    if summary.already_complete:
        click.echo(f"{output}: already complete ({summary.rows} texts in {summary.shards} shards)", err=True)
        return
    resumed = f", resumed after {summary.resumed_at}" if summary.resumed_at else ""
    tokens = f" ({summary.tokens} tokens, {summary.truncated} truncated)" if summary.tokens else ""
    click.echo(f"embedded {summary.added_rows} texts{tokens}{resumed} in {summary.seconds:.2f}s {how} -> "
               f"{output} ({summary.rows} rows in {summary.shards} shards)", err=True)
