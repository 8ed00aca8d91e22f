"""``mbert-export --engine-only BUNDLE``: build the TensorRT engine of an existing --fp16 bundle, check it
inside TensorRT (the precision walk), validate it where it can run, and update manifest and Triton
repo (the engine stage's steps: :mod:`mbert.export.tensorrt.stage`).

It is a transaction like the export: the bundle is staged (hard links), the plan is built and
checked in the staging folder, and the staging folder replaces the bundle only when everything
passed; on any failure the bundle stays byte-identical."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mbert.bundle import open_bundle, write
from mbert.bundle.errors import BundleError, OptionError
from mbert.bundle.names import BUILD_LOG, PLAN, PRECISION_WALK, TOKENIZER
from mbert.bundle.tokenizer import load_tokenizer
from mbert.bundle.validation import grid_cases
from mbert.export.options import ExportOptions
from mbert.export.tensorrt.stage import TIMING_CACHE, build_in, chosen
from mbert.export.transaction import stage_copy, transaction


def build_for_bundle(bundle: Path, options: ExportOptions, report=lambda e, m: None) -> str:
    """Build the engine of ``bundle`` with ``options``' engine settings (``fp16`` must be set: the
    engine is built from the FP16 graph); the Triton repository keeps its own settings. Returns the
    line to print."""
    from mbert.export.triton.writer import record_of, spec_for, write_triton_repository
    from mbert.runtime.backends.family import resolve_family

    options.check()
    if options.engine == "none":
        raise OptionError("--engine-only builds an engine: --engine none (or --no-engine) contradicts it")
    bundle = Path(bundle)
    opened = open_bundle(bundle)
    try:
        manifest = opened.manifest
        fp16 = manifest.graph("fp16")
        if fp16 is None or manifest.precision is None:
            raise BundleError(f"{bundle}: has no FP16 graph; export it with --fp16 first")
        found = resolve_family(options.family)
        report("info", f"engine: {chosen(found, options)}")
        cases = grid_cases(load_tokenizer(opened.path_of(TOKENIZER)), manifest.model, manifest.max_seq_len)
    except BaseException:
        opened.close()
        raise
    with transaction(bundle, overwrite=True, report=lambda msg: report("info", msg)) as tmp:
        stage_copy(opened.root, tmp)  # the bundle that was verified, whatever the path names now
        opened.close()  # its lock would keep the replaced bundle from being deleted
        for name in (PLAN, BUILD_LOG, PRECISION_WALK):
            (tmp / name).unlink(missing_ok=True)
        report("stage", "[1/2] engine: build, precision walk, validation")
        outcome = build_in(tmp, found, options, manifest.max_seq_len, cases, bundle.parent / TIMING_CACHE,
                           say=lambda message: report("info", message))
        report("stage", "[2/2] write")
        updated = replace(manifest, engine=outcome.record,
                          precision=replace(manifest.precision, naive_fp16_tensorrt=outcome.naive))
        old = manifest.triton
        spec = spec_for(updated, max_batch=old.max_batch if old else options.max_batch,
                        encoder=old.encoder if old else "python", length_buckets=old.length_buckets if old else None,
                        ensemble_outputs=old.ensemble_outputs if old else None)
        write_triton_repository(tmp, spec)
        write(tmp, replace(updated, triton=record_of(spec)))
    return f"engine written: {bundle / PLAN}; {outcome.note}"
