"""Can this plan run here? The rules, as pure functions of the engine record and the machine.

* Datacenter TensorRT (``tensorrt``): the same TensorRT version that built the plan, and a GPU of
  the compute capability it was built on; a plan built hardware-compatible
  (``HardwareCompatibilityLevel.AMPERE_PLUS``) runs on any GPU of compute capability 8.0 or newer.
  ("Engines are compatible only with the version of TensorRT used to build them"; "without
  [hardware compatibility] engines are not portable across GPU architectures": TensorRT docs,
  Engine Compatibility.)
* TensorRT-RTX (``tensorrt_rtx``): the same TensorRT-RTX release ("engines are not compatible
  between different releases of TensorRT-RTX") and a GPU whose compute capability is among the
  plan's targets; then, on a GPU, TensorRT-RTX's own header check
  ``Runtime.get_engine_validity`` (driver, CUDA runtime, memory, corruption), see
  :func:`rtx_plan_validity`.
"""
from __future__ import annotations

from pathlib import Path

from .trt_family import EXTRAS, LABELS, Gpu, family_logger, import_family, parse_capability, runtime_version
from .trt_record import EngineRecord

__all__ = ["PORTABLE_CAPABILITIES", "engine_compatibility", "rtx_plan_validity", "can_run"]

# TensorRT-RTX's default targets ("By default, an engine built by TensorRT-RTX can be run on GPU
# devices with compute capability 8.0, 8.6, 8.9, 12.0": TensorRT-RTX docs, CPU-only AOT). This
# project asks for them explicitly, so the record lists exactly what the plan was built for.
PORTABLE_CAPABILITIES = ("8.0", "8.6", "8.9", "12.0")
AMPERE = (8, 0)


def engine_compatibility(record: EngineRecord, *, family_version: str | None,
                         compute_capability: str | None) -> list[str]:
    """Why ``record``'s plan cannot run on a machine with ``family_version`` of the record's family
    installed (None: not installed) and a GPU of ``compute_capability`` (None: no GPU). Empty list:
    the rules allow it (on TensorRT-RTX, :func:`rtx_plan_validity` has the last word)."""
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
    here = parse_capability(compute_capability)
    if record.family == "tensorrt-rtx":
        if compute_capability not in record.targets:
            problems.append(f"GPU compute capability {compute_capability} is not among the plan's targets "
                            f"({', '.join(record.targets)})")
    elif record.options.hardware_compatible:
        if here < AMPERE:
            problems.append(f"GPU compute capability {compute_capability}: the hardware-compatible plan needs "
                            "Ampere or newer (8.0+)")
    else:
        assert record.built_on is not None  # guaranteed by EngineRecord for datacenter plans
        if compute_capability != record.built_on.compute_capability:
            problems.append(f"GPU compute capability: the plan was built for {record.built_on.compute_capability} "
                            f"({record.built_on.name}), this GPU is {compute_capability}")
    return problems


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


def can_run(record: EngineRecord, gpu: Gpu | None, plan: bytes | Path | None = None) -> tuple[bool, list[str]]:
    """Whether the plan can run on ``gpu`` with what is installed here (the family's version is
    read from its module); ``plan`` adds TensorRT-RTX's own validity check when a GPU is present."""
    found = runtime_version(record.family)
    problems = engine_compatibility(record, family_version=found.version if found.ok else None,
                                    compute_capability=gpu.compute_capability if gpu else None)
    if not found.ok and problems:
        problems[0] = f"{LABELS[record.family]} unavailable: {found.reason}"
    if not problems and plan is not None and record.family == "tensorrt-rtx":
        problems = rtx_plan_validity(plan)
    return not problems, problems
