"""The engine record: what a bundle says about its TensorRT plan, as a typed, JSON-round-trippable value.

One record per plan: the family and version that built it, its optimization profiles, what it can
run on (TensorRT-RTX: the compute capabilities it was built for; datacenter TensorRT: the GPU it
was built on, or "any Ampere or newer" when built hardware-compatible), the builder options, the
plan's size and sha256, and where it has been validated. An engine built where it cannot run
(TensorRT-RTX on a machine without a GPU) is a legitimate outcome: its status is "built, not yet
run" with the reason, until a parity run on a supported GPU adds a :class:`Validation`.

``from_dict`` checks every field and raises BundleError naming the key at fault; unknown keys are
refused (the record is part of a sealed manifest).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from mbert.modeling.errors import BundleError, EngineError

from .trt_family import FAMILIES, LABELS, Gpu, parse_capability
from .trt_profiles import Profile

__all__ = ["BuilderOptions", "Validation", "EngineRecord", "STATUS_NOT_RUN", "STATUS_VALIDATED",
           "STATUS_FAILED", "STATUSES"]

STATUS_NOT_RUN = "built, not yet run"
STATUS_VALIDATED = "validated"
STATUS_FAILED = "failed validation"
STATUSES = (STATUS_NOT_RUN, STATUS_VALIDATED, STATUS_FAILED)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a plain file name inside the bundle


def _fail(where: str, message: str) -> BundleError:
    return BundleError(f"engine record: {where} {message}" if where else f"engine record: {message}")


def _take(d: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``d[key]`` checked to be of ``kind`` (bool is not accepted as a number)."""
    if not isinstance(d, dict):
        raise _fail(where, f"must be a JSON object, got {type(d).__name__}")
    if key not in d:
        raise _fail(f"{where}.{key}" if where else key, "is missing")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    numeric = any(k in (int, float) for k in kinds)
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise _fail(f"{where}.{key}" if where else key, f"must be {names}, got {value!r}")
    return value


def _only(d: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise _fail(where or "record", f"has unknown key(s) {extra}")


def _gpu(d: Any, where: str) -> Gpu:
    if not isinstance(d, dict):
        raise _fail(where, f"must be a JSON object, got {d!r}")
    _only(d, {"name", "compute_capability"}, where)
    try:
        return Gpu(_take(d, "name", str, where), _take(d, "compute_capability", str, where))
    except EngineError as exc:
        raise _fail(f"{where}.compute_capability", str(exc)) from None


@dataclass(frozen=True)
class BuilderOptions:
    """How the builder was configured (recorded so a rebuild can repeat it)."""

    workspace_gib: float = 4.0
    optimization_level: int = 3
    tf32: bool = False  # TF32 off: FP32 regions of the plan stay FP32
    strongly_typed: bool = True  # precision comes from the ONNX graph's types and Casts
    hardware_compatible: bool = False  # datacenter only: HardwareCompatibilityLevel.AMPERE_PLUS
    timing_cache: bool = False  # datacenter only: a timing cache was read and written

    def __post_init__(self) -> None:
        if not (isinstance(self.workspace_gib, (int, float)) and not isinstance(self.workspace_gib, bool)
                and math.isfinite(self.workspace_gib) and self.workspace_gib > 0):
            raise EngineError(f"workspace_gib must be a positive number, got {self.workspace_gib!r}")
        if isinstance(self.optimization_level, bool) or self.optimization_level not in range(6):
            raise EngineError(f"builder optimization level must be 0..5, got {self.optimization_level!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "options") -> "BuilderOptions":
        _only(d if isinstance(d, dict) else {}, {f.name for f in dataclasses.fields(cls)}, where)
        kinds = {"workspace_gib": (int, float), "optimization_level": int}
        values = {f.name: _take(d, f.name, kinds.get(f.name, bool), where) for f in dataclasses.fields(cls)}
        try:
            return cls(**values)
        except EngineError as exc:
            raise _fail(where, str(exc)) from None


@dataclass(frozen=True)
class Validation:
    """One parity run of the plan on a GPU: passed or not, and a one-line summary."""

    gpu: Gpu
    version: str  # the family's version that ran it
    passed: bool
    summary: str = ""

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.to_dict(), "version": self.version, "passed": self.passed,
                "summary": self.summary}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Validation":
        _only(d if isinstance(d, dict) else {}, {"gpu", "version", "passed", "summary"}, where)
        return cls(_gpu(_take(d, "gpu", dict, where), f"{where}.gpu"), _take(d, "version", str, where),
                   _take(d, "passed", bool, where), _take(d, "summary", str, where))


@dataclass(frozen=True)
class EngineRecord:
    """See the module docstring. ``targets`` is for TensorRT-RTX (compute capabilities built for);
    ``built_on`` is the build machine's GPU (required for datacenter TensorRT, None for a
    TensorRT-RTX build on a machine without one)."""

    family: str
    version: str
    plan: str  # file name of the plan inside the bundle
    onnx: str  # file name of the graph it was built from
    plan_sha256: str
    plan_bytes: int
    profiles: tuple[Profile, ...]
    targets: tuple[str, ...]
    built_on: Gpu | None
    options: BuilderOptions
    build_seconds: float
    not_run_reason: str = ""  # why the build did not run the plan (no GPU, GPU not targeted, ...)
    validations: tuple[Validation, ...] = ()
    build_log: str | None = None  # file name of the captured builder log, if written

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise EngineError("invalid engine record: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Field consistency, as readable sentences (empty when the record is well formed)."""
        out = []
        if self.family not in FAMILIES:
            out.append(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not re.match(r"^\d+\.\d+", self.version):
            out.append(f"version must look like 1.7.1.116, got {self.version!r}")
        for key in ("plan", "onnx") + (("build_log",) if self.build_log is not None else ()):
            if not _FILE.match(str(getattr(self, key))):
                out.append(f"{key} must be a plain file name inside the bundle, got {getattr(self, key)!r}")
        if not _SHA256.match(self.plan_sha256):
            out.append(f"plan_sha256 must be 64 lowercase hex digits, got {self.plan_sha256!r}")
        if isinstance(self.plan_bytes, bool) or not isinstance(self.plan_bytes, int) or self.plan_bytes <= 0:
            out.append(f"plan_bytes must be a positive int, got {self.plan_bytes!r}")
        if not self.profiles or not all(isinstance(p, Profile) for p in self.profiles):
            out.append("profiles must be a non-empty tuple of Profile")
        for cc in self.targets:
            try:
                parse_capability(cc)
            except EngineError as exc:
                out.append(f"targets: {exc}")
        if self.family == "tensorrt-rtx" and not self.targets:
            out.append("a TensorRT-RTX record must list its target compute capabilities")
        if self.family == "tensorrt":
            if self.targets:
                out.append("targets are for TensorRT-RTX; a datacenter plan runs where it was built")
            if self.built_on is None:
                out.append("a datacenter TensorRT plan must record the GPU it was built on (built_on)")
        elif self.options.hardware_compatible or self.options.timing_cache:
            out.append("hardware_compatible and timing_cache are datacenter TensorRT options")
        if not (isinstance(self.build_seconds, (int, float)) and self.build_seconds >= 0):
            out.append(f"build_seconds must be a non-negative number, got {self.build_seconds!r}")
        return out

    # --- status ----------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        """"validated" once a parity run passed, "failed validation" when the last one failed, else
        "built, not yet run"."""
        if not self.validations:
            return STATUS_NOT_RUN
        return STATUS_VALIDATED if self.validations[-1].passed else STATUS_FAILED

    @property
    def validated_on(self) -> tuple[Gpu, ...]:
        return tuple(v.gpu for v in self.validations if v.passed)

    def with_validation(self, validation: Validation) -> "EngineRecord":
        return dataclasses.replace(self, validations=self.validations + (validation,))

    @property
    def label(self) -> str:
        return f"{LABELS[self.family]} {self.version}"

    def runs_on(self) -> str:
        """Where the plan can run, in words."""
        if self.family == "tensorrt-rtx":
            return f"GPUs of compute capability {', '.join(self.targets)} with {self.label}"
        assert self.built_on is not None
        if self.options.hardware_compatible:
            return f"any Ampere or newer GPU (compute capability >= 8.0) with {self.label}"
        return f"GPUs of compute capability {self.built_on.compute_capability} ({self.built_on.name}) with {self.label}"

    def summary(self) -> str:
        """One line for ``mbert-run info`` and export reports."""
        where = (f"; validated on {', '.join(str(g) for g in self.validated_on)}" if self.validated_on else
                 f" ({self.not_run_reason})" if self.status == STATUS_NOT_RUN and self.not_run_reason else "")
        return (f"{self.plan}: {self.label}, {len(self.profiles)} profile(s), runs on {self.runs_on()}; "
                f"{self.status}{where}")

    # --- JSON ------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "family": self.family, "version": self.version, "plan": self.plan, "onnx": self.onnx,
            "plan_sha256": self.plan_sha256, "plan_bytes": self.plan_bytes,
            "profiles": [p.as_lists() for p in self.profiles], "targets": list(self.targets),
            "built_on": self.built_on.to_dict() if self.built_on else None,
            "options": self.options.to_dict(), "build_seconds": self.build_seconds,
            "status": self.status, "not_run_reason": self.not_run_reason,
            "validations": [v.to_dict() for v in self.validations], "build_log": self.build_log,
        }

    @classmethod
    def from_dict(cls, d: Any) -> "EngineRecord":
        """The record written by :meth:`to_dict`; BundleError naming the key at fault otherwise."""
        if not isinstance(d, dict):
            raise _fail("", f"must be a JSON object, got {type(d).__name__}")
        keys = {"family", "version", "plan", "onnx", "plan_sha256", "plan_bytes", "profiles", "targets",
                "built_on", "options", "build_seconds", "status", "not_run_reason", "validations", "build_log"}
        _only(d, keys, "")
        profiles = []
        for i, p in enumerate(_take(d, "profiles", list, "")):
            try:
                profiles.append(Profile.from_any(p))
            except EngineError as exc:
                raise _fail(f"profiles[{i}]", str(exc)) from None
        targets = _take(d, "targets", list, "")
        if not all(isinstance(t, str) for t in targets):
            raise _fail("targets", f"must be a list of strings such as '8.6', got {targets!r}")
        built = d.get("built_on", None)
        log = d.get("build_log", None)
        if log is not None and not isinstance(log, str):
            raise _fail("build_log", f"must be a file name or null, got {log!r}")
        try:
            record = cls(
                family=_take(d, "family", str, ""), version=_take(d, "version", str, ""),
                plan=_take(d, "plan", str, ""), onnx=_take(d, "onnx", str, ""),
                plan_sha256=_take(d, "plan_sha256", str, ""), plan_bytes=_take(d, "plan_bytes", int, ""),
                profiles=tuple(profiles), targets=tuple(targets),
                built_on=None if built is None else _gpu(built, "built_on"),
                options=BuilderOptions.from_dict(_take(d, "options", dict, "")),
                build_seconds=_take(d, "build_seconds", (int, float), ""),
                not_run_reason=_take(d, "not_run_reason", str, ""),
                validations=tuple(Validation.from_dict(v, f"validations[{i}]")
                                  for i, v in enumerate(_take(d, "validations", list, ""))),
                build_log=log)
        except EngineError as exc:
            raise _fail("", str(exc).removeprefix("invalid engine record: ")) from None
        status = _take(d, "status", str, "")
        if status != record.status:
            raise _fail("status", f"is {status!r} but the validations say {record.status!r}")
        return record
