"""The TensorRT engine stage: build ``model.plan`` from ``model.fp16.onnx`` where TensorRT and a GPU
are present, validate it on the real-text grid, or say in one line why there is no engine and how to
build it later (``mbert-export --engine-only BUNDLE``)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from mbert.bundle import EngineRecord
from mbert.bundle.validation import Case, ValidationReport, compare, tolerances_for

from .runners import onnx_runner

PLAN_FILE = "model.plan"


@dataclass(frozen=True)
class EngineOutcome:
    record: EngineRecord | None
    note: str  # one line for the user: what was built, or why nothing was


def engine_stage(staging: Path, target: Path, max_len: int, options, cases: Sequence[Case]) -> EngineOutcome:
    """Build and validate the plan in ``staging`` (the bundle will be ``target``)."""
    from .tensorrt import build_engine, profiles_from, tensorrt_available

    later = f"build it later on a GPU machine from this bundle with: mbert-export --engine-only {target}"
    if not options.engine:
        return EngineOutcome(None, f"no TensorRT engine (--no-engine); {later}")
    ok, reason = tensorrt_available()
    if not ok:
        return EngineOutcome(None, f"no TensorRT engine: {reason}; {later}")
    profiles = profiles_from(options.max_batch, max_len, options.opt_batch, options.opt_seq_len,
                             list(options.split_seq) if options.split_seq else None)
    record = build_engine(staging / "model.fp16.onnx", staging / PLAN_FILE, profiles,
                          workspace_gib=options.workspace_gib, timing_cache_path=target.parent / ".trt-timing.cache")
    record = replace(record, validation=validate_engine(staging, cases))
    return EngineOutcome(record, f"TensorRT {record.tensorrt_version} engine built for {record.gpu_name}")


def validate_engine(folder: Path, cases: Sequence[Case]) -> ValidationReport:
    """The plan against the bundle's FP32 ONNX graph on ONNX Runtime (the eager model's proven twin)."""
    from mbert.runtime.tensorrt import TensorRTRunner

    runner = TensorRTRunner(folder / PLAN_FILE)

    def run(ids: np.ndarray, mask: np.ndarray):
        return {k: np.asarray(v) for k, v in runner.run(input_ids=ids, attention_mask=mask).items()}

    reference = onnx_runner(folder / "model.onnx")
    names = list(reference(cases[0].input_ids, cases[0].attention_mask))
    report = compare(PLAN_FILE, run, reference, cases, tolerances_for("fp16", names))
    report.raise_if_failed()
    return report
