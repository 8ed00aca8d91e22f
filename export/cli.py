"""``mbert-export``: checkpoint -> validated bundle (ONNX; with --fp16 also mixed precision, TensorRT, Triton;
with --int8 also a planned dynamic-INT8 graph for CPU serving).

Exit codes: 0 done; 1 bad input or environment (a corrupt checkpoint, a bundle in the way, a
folder that cannot be written); 2 usage (an unknown option, a value out of range); 3 internal error
(a bug: please report it with ``--debug``'s traceback); 130 interrupted (Ctrl-C or SIGTERM: nothing
is left behind). Errors print one line; ``--debug`` shows the traceback. Heavy modules are imported
only after the arguments parse, so ``--help`` is instant.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from mbert.bundle.names import TRITON_ENCODERS


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model", required=False)
@click.option("--out", type=click.Path(path_type=Path), help="Bundle folder (default: engines/<model-name>).")
@click.option("--max-seq-len", type=int, help="Longest input the bundle accepts (default: the checkpoint's; >= 2).")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18+: see mbert.export.onnx.trace).")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle (only a bundle of this tool).")
@click.option("--task", type=click.Choice(["encoder", "masked-lm", "sequence-classification", "token-classification"]),
              help="Override the head chosen from config.json 'architectures' (encoder: hidden states only).")
@click.option("--fp16", is_flag=True, help="Also scan for FP16 overflow, write a mixed-precision ONNX, build a TensorRT engine.")
@click.option("--int8", is_flag=True, help="Also plan and validate model.int8.onnx (dynamic INT8, CPU; see README).")
@click.option("--calibration", type=click.Path(path_type=Path), help="Your own text (one per line, or .jsonl) added to the built-in set.")
@click.option("--margin", type=float, default=8.0, show_default=True, help="Required FP16 headroom factor; sites above 65504/margin stay FP32.")
@click.option("--max-batch", type=int, default=32, show_default=True, help="Largest batch of the engine profiles and Triton.")
@click.option("--opt-batch", type=int, help="Batch TensorRT tunes for (default: max-batch/2).")
@click.option("--opt-seq-len", type=int, help="Sequence length TensorRT tunes for (default: 512).")
@click.option("--split-seq", help="Several engine profiles split at these lengths, e.g. 512,8192.")
@click.option("--workspace-gib", type=float, help="Cap on the TensorRT builder's workspace (default: TensorRT's own, "
              "the GPU's memory).")
@click.option("--engine", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx", "none"]), default=None,
              help="With --fp16: the TensorRT family that builds the engine (default auto: the builder installed "
                   "here; tensorrt: datacenter GPUs and Triton; tensorrt-rtx: RTX/A10/L4 GPUs, builds without a GPU).")
@click.option("--compute-capability", "compute_capability",
              help="TensorRT-RTX targets, e.g. 8.6,8.9,12.0 (default: 8.0,8.6,8.9,12.0).")
@click.option("--hardware-compatible", is_flag=True,
              help="Datacenter TensorRT: a plan for any Ampere or newer GPU (possibly slower).")
@click.option("--no-engine", is_flag=True, help="With --fp16: skip the TensorRT engine (same as --engine none).")
@click.option("--triton-encoder", type=click.Choice(TRITON_ENCODERS), default="python", show_default=True,
              help="What the Triton ensemble routes to: ONNX Runtime in the Python backend (any Triton), the ONNX "
                   "Runtime backend, or the TensorRT plan. Switch later with mbert-run serve --encoder.")
@click.option("--engine-only", "engine_only", type=click.Path(path_type=Path),
              help="Build the TensorRT engine for an existing --fp16 bundle (where a TensorRT builder is installed), "
                   "no re-export.")
@click.option("--random-checkpoint", "random_checkpoint", type=click.Path(path_type=Path),
              help="Write a checkpoint with RANDOM weights (ModernBERT's architecture and tokenizer) to this "
                   "folder and stop: for trying the tool offline.")
@click.option("--preset", type=click.Choice(["tiny", "base"]), default="tiny", show_default=True,
              help="With --random-checkpoint: 'base' is the published ModernBERT-base shape, 'tiny' a small one.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the eager passes run (FP16 scan, reference outputs); auto = CUDA when torch sees a GPU.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(model, out, max_seq_len, opset, overwrite, task, fp16, int8, calibration, margin, max_batch, opt_batch,
         opt_seq_len, split_seq, workspace_gib, engine, compute_capability, hardware_compatible, no_engine,
         triton_encoder, engine_only, random_checkpoint, preset, device, debug):
    """Export a ModernBERT-family checkpoint (hub id or local folder) to a validated bundle.

    \b
    mbert-export answerdotai/ModernBERT-base            # needs network (or the HF cache)
    mbert-export ./my-checkpoint --fp16 --max-seq-len 2048
    mbert-export ./my-checkpoint --int8                  # + model.int8.onnx for CPU serving
    mbert-export ./my-checkpoint --fp16 --engine tensorrt-rtx --compute-capability 8.6,8.9
    mbert-export --engine-only engines/my-checkpoint    # later, where a TensorRT builder is installed
    mbert-export --random-checkpoint ./random-tiny      # RANDOM weights, to try the tool offline
    """
    split = _ints(split_seq)
    if no_engine and engine not in (None, "none"):
        raise click.UsageError(f"--no-engine contradicts --engine {engine}")
    engine = "none" if no_engine else engine or "auto"
    targets = tuple(c.strip() for c in compute_capability.split(",")) if compute_capability is not None else None
    if sum(x is not None for x in (model, engine_only, random_checkpoint)) != 1:
        raise click.UsageError("give exactly one of MODEL (a hub id or checkpoint folder), --engine-only BUNDLE "
                               "or --random-checkpoint FOLDER")
    from mbert.export.report import echo, summary
    from mbert.export.transaction import sigterm_as_interrupt

    sigterm_as_interrupt()
    if not debug:  # TensorRT's own warnings and errors go to the build logs in the bundle, not the terminal
        import logging

        logging.getLogger("mbert.tensorrt").addHandler(logging.NullHandler())
    try:
        if random_checkpoint is not None:
            from mbert.modeling.random import write_random_checkpoint

            folder = write_random_checkpoint(random_checkpoint, preset)
            click.echo(f"wrote a checkpoint with RANDOM weights ({preset}) to {folder}; export it with: "
                       f"mbert-export {folder}")
            return
        if engine_only is not None:
            from mbert.export.options import ExportOptions
            from mbert.export.tensorrt.engine_only import build_for_bundle

            options = ExportOptions(fp16=True, max_batch=max_batch, opt_batch=opt_batch, opt_seq_len=opt_seq_len,
                                    split_seq=split, workspace_gib=workspace_gib, engine=engine,
                                    compute_capabilities=targets, hardware_compatible=hardware_compatible)
            click.echo(build_for_bundle(engine_only, options, report=echo))
            return
        from mbert.export.options import ExportOptions
        from mbert.export.pipeline import export_bundle

        options = ExportOptions(out=out, max_seq_len=max_seq_len, opset=opset, overwrite=overwrite, task=task,
                                fp16=fp16, calibration=calibration, margin=margin, max_batch=max_batch,
                                opt_batch=opt_batch, opt_seq_len=opt_seq_len, split_seq=split,
                                workspace_gib=workspace_gib, engine=engine, compute_capabilities=targets,
                                hardware_compatible=hardware_compatible, triton_encoder=triton_encoder, int8=int8,
                                device=device)
        t0 = time.perf_counter()
        result = export_bundle(model, options, report=echo)
        click.echo(summary(result))
        click.echo(f"\nTotal {time.perf_counter() - t0:.1f}s")
    except KeyboardInterrupt:
        click.echo("interrupted: no bundle was written or changed", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line and an exit code
        from mbert.export.transaction import was_interrupted

        if was_interrupted():  # the interrupt was caught and re-raised as another error on its way up
            click.echo("interrupted: no bundle was written or changed", err=True)
            sys.exit(130)
        if debug:
            raise
        sys.exit(fail(exc))


def fail(exc: BaseException) -> int:
    """Print ``exc`` as one line; returns the exit code (see the module docstring)."""
    from mbert.bundle.errors import failure

    line, code = failure(exc)
    click.echo(line, err=True)
    return code


def _ints(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--split-seq")


if __name__ == "__main__":
    main()
