"""The first run of a "built, not yet run" engine: the parity grid on this GPU, its verdict cached per user.

A plan exported where it could not run (TensorRT-RTX on a machine without a GPU, or on a GPU the
plan does not target) has no validation in its manifest. The first time the runtime opens it on a
GPU that can run it (:func:`mbert.runtime.backends.checks.can_run`), it runs the export's parity grid: the
plan against the bundle's FP32 ONNX graph on ONNX Runtime CPU (the graph the export proved equal to
the eager model), on the built-in real texts over ``default_grid`` up to the bundle's max length,
judged by the FP16 tolerances of :mod:`mbert.bundle.validation`. A plan that fails is refused,
saying why.

The bundle is sealed and never modified by the runtime, so the verdict (pass or fail, with its
report) is cached in the user's cache folder (``$XDG_CACHE_HOME/mbert/engine-verdicts``, default
``~/.cache/mbert/engine-verdicts``), one JSON file per (plan sha256, GPU name and compute capability,
family and version): the grid runs once per plan, GPU and TensorRT release. Delete a file to run the
grid again. A plan validated at export on a GPU of the same compute capability needs no first run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mbert.bundle import Bundle
from mbert.bundle.engine import EngineRecord, Family, Gpu
from mbert.bundle.errors import BundleError, EngineError
from mbert.bundle.files import atomic_write
from mbert.bundle.names import TOKENIZER
from mbert.bundle.schema import from_json, to_json
from mbert.bundle.tensors import Runner
from mbert.bundle.validation import Case, ValidationReport

log = logging.getLogger("mbert.runtime")


@dataclass(frozen=True)
class EngineVerdict:
    """The parity grid's verdict on one plan, on one GPU, with one release of its family."""

    plan_sha256: str
    gpu: Gpu
    family: Family
    version: str
    checked: str  # when, UTC
    report: ValidationReport


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbert" / "engine-verdicts"


def needs_first_run(record: EngineRecord, gpu: Gpu) -> bool:
    """True unless the export validated the plan on a GPU of ``gpu``'s compute capability."""
    return record.validation is None or record.validation.gpu.compute_capability != gpu.compute_capability


def verdict_path(cache_dir: Path, plan_sha256: str, gpu: Gpu, record: EngineRecord) -> Path:
    key = "\n".join((plan_sha256, gpu.name, gpu.compute_capability, record.family, record.version))
    return Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def engine_parity(run: Runner, fp32_graph: Path, cases: Sequence[Case], artifact: str,
                  outputs: Sequence[str]) -> ValidationReport:
    """``run`` (a plan) against the bundle's FP32 graph on ONNX Runtime CPU (the graph the export proved
    equal to the eager model), on ``cases``, judged by the FP16 tolerances: the one engine parity
    check, at export and at a plan's first run."""
    from mbert.bundle.validation import compare, tolerances_for
    from mbert.runtime.backends.onnxruntime import onnx_runner

    return compare(artifact, run, onnx_runner(fp32_graph), cases, tolerances_for("fp16", outputs))


def bundle_engine_parity(bundle: Bundle, run: Runner) -> ValidationReport:
    """:func:`engine_parity` of ``bundle``'s plan on the export's grid up to its max length."""
    from mbert.bundle.tokenizer import load_tokenizer
    from mbert.bundle.validation import grid_cases

    m = bundle.manifest
    fp32 = m.graph("fp32")
    if fp32 is None:
        raise BundleError(f"{bundle.path}: has no FP32 graph to check the engine against")
    cases = grid_cases(load_tokenizer(bundle.path_of(TOKENIZER)), m.model, m.max_seq_len)
    return engine_parity(run, bundle.path_of(fp32.file, "graphs.file"), cases, m.engine.file, m.io.output_names)


def first_open_check(bundle: Bundle, run: Runner, gpu: Gpu, *, cache_dir: Path | None = None) -> EngineVerdict | None:
    """The verdict on the bundle's plan on ``gpu`` (``run`` executes the plan): None when the export
    already validated it on this compute capability, else the cached verdict or a fresh parity run,
    cached. EngineError, saying why, when the plan failed its parity run (now or before)."""
    record = bundle.manifest.engine
    assert record is not None, "first_open_check needs a bundle with an engine"
    if not needs_first_run(record, gpu):
        return None
    sha = bundle.manifest.files[record.file].sha256
    path = verdict_path(cache_dir or default_cache_dir(), sha, gpu, record)
    verdict = _read(path)
    if verdict is None or (verdict.plan_sha256, verdict.gpu, verdict.version) != (sha, gpu, record.version):
        log.warning("mbert.runtime: %s was %s; running the parity grid on %s once (the verdict is cached in %s)",
                    record.file, record.status if record.validation is None else f"validated on {record.validation.gpu}",
                    gpu, path)
        report = bundle_engine_parity(bundle, run)
        verdict = EngineVerdict(sha, gpu, record.family, record.version,
                                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), report)
        _write(path, verdict)
    if not verdict.report.passed:
        failed = "; ".join(o.describe() for o in verdict.report.outputs if not o.passed)
        raise EngineError(f"{bundle.path}: {record.file} ({record.label}) failed the parity grid on {gpu} "
                          f"({verdict.checked}; verdict cached in {path}): {failed}. The plan is refused: run the ONNX "
                          f"graph with backend='onnxruntime', or rebuild with mbert-export --engine-only {bundle.path}")
    return verdict


def _read(path: Path) -> EngineVerdict | None:
    if not path.is_file():
        return None
    try:
        return from_json(EngineVerdict, json.loads(path.read_text(encoding="utf-8")), "")
    except (OSError, ValueError, BundleError) as exc:  # unreadable or from another version: run again
        log.warning("mbert.runtime: ignoring the unreadable engine verdict %s (%s)", path, exc)
        return None


def _write(path: Path, verdict: EngineVerdict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(to_json(verdict), indent=2, allow_nan=False))
