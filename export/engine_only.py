"""``mbert-export --engine-only BUNDLE``: build the TensorRT engine of an existing --fp16 bundle on a
GPU machine, validate it against the bundle's FP32 ONNX graph, and update manifest and Triton repo.

It is a transaction like the export: the bundle is staged (hard links), the plan is built and
validated in the staging folder, and the staging folder replaces the bundle only when everything
passed; on any failure the bundle stays byte-identical."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mbert.bundle import open_bundle, write
from mbert.bundle.texts import calibration_texts
from mbert.bundle.validation import build_cases, default_grid
from mbert.modeling.errors import BundleError, EngineError
from mbert.modeling.tokenizer import load_tokenizer

from .engine import PLAN_FILE, validate_engine
from .transaction import stage_copy, transaction


def build_for_bundle(bundle: Path, *, max_batch: int, opt_batch=None, opt_seq_len=None, split_seq=None,
                     workspace_gib: float = 4.0, report=lambda e, m: None) -> str:
    from .tensorrt import build_engine, profiles_from, tensorrt_available
    from .triton import repository_for

    bundle = Path(bundle)
    opened = open_bundle(bundle)
    manifest = opened.manifest
    fp16 = manifest.graph("fp16")
    if fp16 is None:
        raise BundleError(f"{bundle}: has no FP16 graph; export it with --fp16 first")
    ok, reason = tensorrt_available()
    if not ok:
        raise EngineError(f"cannot build an engine here: {reason}")
    profiles = profiles_from(max_batch, manifest.max_seq_len, opt_batch, opt_seq_len, split_seq)
    m = manifest.model
    cases = build_cases(load_tokenizer(bundle), calibration_texts(),
                        default_grid(m.local_attention // 2, manifest.max_seq_len),
                        m.cls_token_id, m.sep_token_id, m.pad_token_id)
    with transaction(bundle, overwrite=True, report=lambda msg: report("info", msg)) as tmp:
        stage_copy(bundle, tmp)
        (tmp / PLAN_FILE).unlink(missing_ok=True)
        report("stage", "[1/3] engine")
        record = build_engine(tmp / fp16.file, tmp / PLAN_FILE, profiles, workspace_gib=workspace_gib,
                              timing_cache_path=bundle.parent / ".trt-timing.cache")
        report("stage", "[2/3] validate engine")
        record = replace(record, validation=validate_engine(tmp, cases))
        report("stage", "[3/3] write")
        updated = replace(manifest, engine=record)
        write(tmp, replace(updated, triton=repository_for(tmp, updated, max_batch=max_batch)))
    return (f"engine written: {bundle / PLAN_FILE} (TensorRT {record.tensorrt_version}, {record.gpu_name})")
