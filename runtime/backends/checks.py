"""The runtime's checks beyond the bundle's own verification (``mbert.bundle.open_bundle``).

* A loaded graph or engine must have the inputs and outputs the manifest records (:func:`check_graph_io`).
* A TensorRT plan must be able to run on this machine by its family's rules (:func:`engine_compatibility`,
  :func:`can_run`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mbert.bundle import Bundle
from mbert.bundle.engine import LABELS, EngineRecord, Gpu, parse_capability
from mbert.bundle.errors import BundleError
from mbert.bundle.manifest import REEXPORT
from mbert.runtime.backends.family import EXTRAS, family_logger, import_family, runtime_version


def check_graph_io(bundle: Bundle, artifact: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """The loaded graph's / engine's own input and output names must be the manifest's."""
    io = bundle.manifest.io
    want_in, want_out = [i.name for i in io.inputs], list(io.output_names)
    if sorted(inputs) != sorted(want_in) or sorted(outputs) != sorted(want_out):
        raise BundleError(f"{bundle.path}: {artifact} has inputs {list(inputs)} and outputs {list(outputs)}, the "
                          f"manifest says {want_in} and {want_out}; {REEXPORT}")


def engine_compatibility(record: EngineRecord, *, family_version: str | None,
                         compute_capability: str | None) -> list[str]:
    """Why ``record``'s plan cannot run on a machine with ``family_version`` of the record's family
    installed (None: not installed) and a GPU of ``compute_capability`` (None: no GPU); empty when the
    rules allow it. The rules follow the family:

    * datacenter TensorRT: the TensorRT version that built the plan and a GPU of the compute capability
      it was built on ("Engines are compatible only with the version of TensorRT used to build them";
      without hardware compatibility "engines are not portable across GPU architectures": TensorRT
      docs, Engine Compatibility); a plan built hardware-compatible (AMPERE_PLUS) runs on any GPU of
      compute capability 8.0 or newer. The GPU's name may differ (same architecture, other SKU).
    * TensorRT-RTX: the release that built it ("engines are not compatible between different releases
      of TensorRT-RTX") and a GPU whose compute capability is among the plan's targets; on a GPU,
      TensorRT-RTX's own header check has the last word (:func:`can_run`).
    """
    label = LABELS[record.family]
    problems = []
    if family_version is None:
        problems.append(f"{label} is not installed ({EXTRAS[record.family]})")
    elif family_version != record.version:
        problems.append(f"{label} version: the plan was built with {record.version}, this machine has "
                        f"{family_version} (plans run only with the release that built them)")
    if compute_capability is None:
        problems.append("no CUDA GPU")
        return problems
    if record.family == "tensorrt-rtx":
        if compute_capability not in record.targets:
            problems.append(f"GPU compute capability {compute_capability} is not among the plan's targets "
                            f"({', '.join(record.targets)})")
    elif record.options.hardware_compatible:
        if parse_capability(compute_capability) < (8, 0):
            problems.append(f"GPU compute capability {compute_capability}: the hardware-compatible plan needs "
                            "Ampere or newer (8.0+)")
    else:
        assert record.built_on is not None  # EngineRecord requires it for datacenter plans
        if compute_capability != record.built_on.compute_capability:
            problems.append(f"GPU compute capability: the plan was built for {record.built_on.compute_capability} "
                            f"({record.built_on.name}), this GPU is {compute_capability}")
    return problems


def can_run(record: EngineRecord, gpu: Gpu | None, plan: Path | None = None) -> tuple[bool, list[str]]:
    """Whether the plan can run on ``gpu`` with what is installed here (the family's version is read
    from its module, without a GPU probe); with ``plan`` and a GPU, a TensorRT-RTX plan must also pass
    TensorRT-RTX's own validity check (driver, CUDA runtime, corruption)."""
    found = runtime_version(record.family)
    problems = engine_compatibility(record, family_version=found.version if found.ok else None,
                                    compute_capability=gpu.compute_capability if gpu else None)
    if not found.ok:
        problems[0] = f"{LABELS[record.family]} unavailable: {found.reason}"
    if not problems and plan is not None and record.family == "tensorrt-rtx":
        problems = rtx_plan_validity(plan)
    return not problems, problems


def check_engine(bundle: Bundle, gpu: Gpu | None) -> None:
    """BundleError saying why the bundle's plan cannot run here and how to rebuild it."""
    engine = bundle.manifest.engine
    if engine is None:
        raise BundleError(f"{bundle.path}: has no TensorRT engine; build it with: mbert-export --engine-only "
                          f"{bundle.path}")
    ok, problems = can_run(engine, gpu, bundle.path_of(engine.file, "engine.file"))
    if not ok:
        raise BundleError(
            f"{bundle.path}: {engine.file} ({engine.label}, runs on {engine.runs_on()}) cannot run here: "
            f"{'; '.join(problems)}. Rebuild the engine for this machine with: mbert-export --engine-only "
            f"{bundle.path} (or run the ONNX graph with backend='onnxruntime')")


def rtx_plan_validity(plan: bytes | Path) -> list[str]:
    """TensorRT-RTX's header check of a plan on this machine (``Runtime.get_engine_validity``):
    empty when VALID or SUBOPTIMAL, else the reasons it reports. Without a GPU it always answers
    INVALID (measured with 1.7.1), so call it only where a GPU is present."""
    trt = import_family("tensorrt-rtx")
    blob = Path(plan).read_bytes() if isinstance(plan, (str, Path)) else plan
    runtime = trt.Runtime(family_logger(trt))
    validity, diagnostics = runtime.get_engine_validity(blob)
    if validity != trt.EngineValidity.INVALID:
        return []
    flags = [name for name, member in trt.EngineInvalidityDiagnostics.__members__.items()
             if int(diagnostics) & int(member)]
    return [f"TensorRT-RTX's validity check says INVALID ({', '.join(flags) or 'no diagnostics given'})"]
