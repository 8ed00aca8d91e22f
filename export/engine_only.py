"""``mbert-export --engine-only BUNDLE``: build the TensorRT engine of an existing --fp16 bundle on a
GPU machine, validate it against the bundle's FP32 ONNX graph, and update manifest and Triton repo.
The plan is written beside the bundle first and listed in the manifest last, so an interrupted
build leaves the bundle as it was."""
from __future__ import annotations

import os
from pathlib import Path

from mbert.modeling.errors import BundleError, EngineError

from . import bundle as bundle_mod
from .fp16 import validate_engine
from .texts import calibration_texts
from .validate import build_cases, default_grid, load_tokenizer


def build_for_bundle(bundle: Path, *, max_batch: int, opt_batch=None, opt_seq_len=None, split_seq=None,
                     workspace_gib: float = 4.0, report=lambda e, m: None) -> str:
    from .tensorrt import build_engine, profiles_from, tensorrt_available
    from .triton import write_triton_repository

    bundle = Path(bundle)
    manifest = bundle_mod.read_manifest(bundle, verify=True)
    if not (bundle / "model.fp16.onnx").is_file():
        raise BundleError(f"{bundle}: has no model.fp16.onnx; export it with --fp16 first")
    ok, reason = tensorrt_available()
    if not ok:
        raise EngineError(f"cannot build an engine here: {reason}")
    max_len = manifest["max_seq_len"]
    profiles = profiles_from(max_batch, max_len, opt_batch, opt_seq_len, split_seq)
    tmp_plan = bundle / ".model.plan.partial"
    report("stage", "[1/3] engine")
    try:
        info = build_engine(bundle / "model.fp16.onnx", tmp_plan, profiles, workspace_gib=workspace_gib,
                            timing_cache_path=bundle.parent / ".trt-timing.cache")
        os.replace(tmp_plan, bundle / "model.plan")
    finally:
        tmp_plan.unlink(missing_ok=True)
    report("stage", "[2/3] validate engine")
    m = manifest["model"]
    cases = build_cases(load_tokenizer(bundle), calibration_texts(), default_grid(m["local_attention"] // 2, max_len),
                        m["cls_token_id"], m["sep_token_id"], m["pad_token_id"])
    try:
        info["validation"] = validate_engine(bundle, cases).to_dict()
    except Exception:
        (bundle / "model.plan").unlink(missing_ok=True)
        raise
    report("stage", "[3/3] write")
    manifest["engine"] = info
    manifest["artifacts"]["engine"] = "model.plan"
    write_triton_repository(bundle, manifest, has_plan=True, profiles=info.get("profiles"), max_batch=max_batch)
    manifest.pop("files", None)
    bundle_mod.write_manifest(bundle, manifest)
    return f"engine written: {bundle / 'model.plan'} (TensorRT {info.get('tensorrt_version')}, {info.get('gpu_name')})"
