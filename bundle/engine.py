"""The TensorRT engine's records in the manifest: what built the plan, for which GPUs, what TensorRT's
own network computes in which precision, and where the plan has been run.

Two families build plans (:data:`FAMILIES`): datacenter TensorRT (``tensorrt``; its builder needs a
GPU and the plan runs where it was built, or on any Ampere or newer GPU when built
hardware-compatible) and TensorRT for RTX (``tensorrt-rtx``; builds with no GPU for a list of target
compute capabilities). An engine built where it cannot run is a legitimate outcome: its record has
no ``validation`` and says why (``not_run_reason``): "built, not yet run". The runtime runs the
parity grid on such a plan the first time it opens it on a supported GPU (``mbert.runtime.backends.verdicts``).

Pure Python (no TensorRT import). Every value is checked when a record is made, so a manifest that
parses is consistent (:mod:`mbert.bundle.schema` turns a ``ValueError`` here into a BundleError
naming the record).
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Literal

from mbert.bundle.errors import PrecisionError
from mbert.bundle.paths import RelPath
from mbert.bundle.validation import ValidationReport

Family = Literal["tensorrt", "tensorrt-rtx"]
FAMILIES: tuple[str, ...] = ("tensorrt", "tensorrt-rtx")
LABELS = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
STATUS_NOT_RUN = "built, not yet run"
STATUS_VALIDATED = "validated"
_CAPABILITY = re.compile(r"^(\d{1,2})\.(\d)$")
_PRECISIONS = ("float16", "float32", "bfloat16", "mixed", "none")
_SHORT = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}


def parse_capability(text: str) -> tuple[int, int]:
    """``"8.6"`` -> ``(8, 6)``; ValueError naming the text otherwise."""
    m = _CAPABILITY.match(str(text).strip())
    if not m:
        raise ValueError(f"not a compute capability: {text!r} (expected MAJOR.MINOR such as 8.6 or 12.0)")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile: (batch, sequence) for every network input."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            value = getattr(self, name)
            try:
                if isinstance(value, (str, bytes)) or len(value) != 2 or any(isinstance(v, bool) for v in value):
                    raise TypeError
                object.__setattr__(self, name, (operator.index(value[0]), operator.index(value[1])))
            except TypeError:
                raise ValueError(f"profile {name} must be a (batch, sequence) pair of ints, got {value!r}") from None
        for axis, label in ((0, "batch"), (1, "sequence")):
            lo, mid, hi = self.min[axis], self.opt[axis], self.max[axis]
            if not 1 <= lo <= mid <= hi:
                raise ValueError(f"profile {label} sizes must satisfy 1 <= min <= opt <= max, "
                                 f"got min={lo} opt={mid} max={hi}")

    def covers(self, batch: int, seq: int) -> bool:
        return self.min[0] <= batch <= self.max[0] and self.min[1] <= seq <= self.max[1]

    def __str__(self) -> str:
        return f"min={self.min} opt={self.opt} max={self.max}"


@dataclass(frozen=True)
class Gpu:
    """A GPU by name and compute capability ("8.6")."""

    name: str
    compute_capability: str

    def __post_init__(self) -> None:
        parse_capability(self.compute_capability)

    def __str__(self) -> str:
        return f"{self.name} (compute capability {self.compute_capability})"


@dataclass(frozen=True)
class BuilderOptions:
    """How the builder was configured (so a rebuild can repeat it)."""

    workspace_gib: float  # the workspace limit the builder config had (ours, or TensorRT's default)
    optimization_level: int
    tf32: bool  # False: FP32 regions of the plan stay FP32
    strongly_typed: bool  # precision comes from the ONNX graph's types and Casts
    hardware_compatible: bool  # datacenter only: HardwareCompatibilityLevel.AMPERE_PLUS
    timing_cache: bool  # datacenter only: a timing cache was read and written

    def __post_init__(self) -> None:
        if not (math.isfinite(self.workspace_gib) and self.workspace_gib > 0):
            raise ValueError(f"workspace_gib must be a positive number, got {self.workspace_gib!r}")
        if self.optimization_level not in range(6):
            raise ValueError(f"builder optimization level must be 0..5, got {self.optimization_level!r}")


@dataclass(frozen=True)
class TensorRTVerdict:
    """Whether a TensorRT family accepts a graph: parsed, built, and its own error text if not."""

    family: Family
    version: str
    parsed: bool
    built: bool
    error: str | None  # TensorRT's error, verbatim on one line; None when it built

    def describe(self, limit: int = 240) -> str:
        """One line, TensorRT's error cut to about ``limit`` characters."""
        label = f"{LABELS[self.family]} {self.version}"
        if self.built:
            return f"{label}: builds"
        text = f"{label}: {'does not build' if self.parsed else 'does not parse'}: {self.error}"
        return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class SiteCheck:
    """One precision-plan site (``layers.1.mlp``, ``final_norm``) as TensorRT's parsed network has it:
    the plan's precision, TensorRT's, the layer counts behind it and the verdict."""

    site: str  # "layers.1.mlp", "embeddings", "final_norm", "head"
    layer: int | None
    group: str  # residual / attention / mlp / embeddings / final_norm / head
    plan: str  # float16 / float32 (none: the plan has no such site)
    tensorrt: str  # float16 / float32 / mixed / none: the dtype of the defining layers
    defining: str  # which layers decide: "matrix products", "residual adds", "site outputs"
    defining_fp16: int
    defining_fp32: int
    compute_fp16: int  # all compute layers of the site (softmax and LayerNorm statistics stay FP32
    compute_fp32: int  # inside FP16 sites)
    passed: bool
    why: str  # why it failed ("" when it passed)

    def __post_init__(self) -> None:
        for value in (self.plan, self.tensorrt):
            if value not in _PRECISIONS:
                raise ValueError(f"site {self.site}: precision must be one of {', '.join(_PRECISIONS)}, got {value!r}")


@dataclass(frozen=True)
class NetworkCounts:
    """TensorRT's parsed network: its layers, its compute layers per dtype, and how layers were placed."""

    layers: int
    fp16_layers: int  # compute layers (matrix products, elementwise, normalization, softmax, ...) in FP16
    bf16_layers: int
    fp32_layers: int
    casts: int
    placed_by_metadata: int  # through the ONNX node in the layer's metadata and its name scope
    placed_by_connection: int  # parser-made layers, through the sites of the layers they connect
    outside: int  # layers of nodes outside the encoder (graph wrapper, pooling, RoPE positions)
    unplaced: int


@dataclass(frozen=True)
class PrecisionWalk:
    """The FP16 plan checked inside TensorRT: every site's precision in the network TensorRT built
    from the FP16 graph (``file`` lists every TensorRT layer with its site and dtypes), and the
    verdict (``mbert.export.tensorrt.precision`` computes it)."""

    file: RelPath  # tensorrt_precision.json
    onnx: RelPath  # the graph walked
    family: Family
    version: str
    sites: tuple[SiteCheck, ...]
    network: NetworkCounts
    unplaced: dict[str, int]  # "LAYER_TYPE dtype" -> count of compute layers with no site
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def fp32_sites(self) -> list[str]:
        return [s.site for s in self.sites if s.tensorrt == "float32"]

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PrecisionError(f"TensorRT's network disagrees with the FP16 plan ({self.onnx}): "
                                 + "; ".join(self.problems))

    def table(self) -> list[str]:
        """The per-site table as text lines."""
        lines = [f"TensorRT precision walk ({LABELS[self.family]} {self.version}, {self.onnx}): "
                 + ("passed" if self.passed else "FAILED"),
                 f"{'site':<22} {'plan':<8} {'tensorrt':<8} {'fp16':>5} {'fp32':>5}  verdict"]
        for s in self.sites:
            lines.append(f"{s.site:<22} {_SHORT.get(s.plan, s.plan):<8} {_SHORT.get(s.tensorrt, s.tensorrt):<8} "
                         f"{s.compute_fp16:>5} {s.compute_fp32:>5}  {'ok' if s.passed else 'FAIL: ' + s.why}")
        site_problems = sum(not s.passed for s in self.sites)  # the walk lists them first
        return lines + [f"problem: {p}" for p in self.problems[site_problems:]]

    def per_layer(self) -> list[tuple[str, str, int, int, str]]:
        """Rows (layer or model-level site, where TensorRT runs it, FP16 and FP32 compute layers,
        verdict): ``("2", "FP32: residual, mlp", 5, 22, "ok")``."""
        groups: dict[str, list[SiteCheck]] = {}
        for s in self.sites:
            groups.setdefault(str(s.layer) if s.layer is not None else s.site, []).append(s)
        rows = []
        for name, members in groups.items():
            if members[0].layer is None:  # embeddings, final_norm, head
                runs = _SHORT.get(members[0].tensorrt, members[0].tensorrt).replace("fp32", "FP32")
            else:
                fp32 = [s.group for s in members if s.tensorrt != "float16"]
                runs = "FP32: " + ", ".join(fp32) if fp32 else "fp16"
            rows.append((name, runs, sum(s.compute_fp16 for s in members), sum(s.compute_fp32 for s in members),
                         "ok" if all(s.passed for s in members) else "FAIL"))
        return rows


@dataclass(frozen=True)
class EngineValidation:
    """One parity run of the plan on a GPU, against the bundle's FP32 graph on ONNX Runtime."""

    gpu: Gpu
    version: str  # the family's version that ran it
    report: ValidationReport


@dataclass(frozen=True)
class EngineRecord:
    """A TensorRT plan of the bundle. ``targets``: the compute capabilities a TensorRT-RTX plan was
    built for; ``built_on``: the build machine's GPU (always, for datacenter TensorRT; None for a
    TensorRT-RTX build on a machine without one). ``validation`` is None exactly when the plan has
    not been run at export, and ``not_run_reason`` then says why."""

    file: RelPath  # model.plan
    onnx: RelPath  # the graph it was built from
    family: Family
    version: str
    profiles: tuple[Profile, ...]
    targets: tuple[str, ...]
    built_on: Gpu | None
    options: BuilderOptions
    build_seconds: float
    build_log: RelPath  # tensorrt_build.log: warnings, engine layer information, attention fusion
    precision_walk: PrecisionWalk
    validation: EngineValidation | None
    not_run_reason: str | None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid engine record: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if not re.match(r"^\d+\.\d+", self.version):
            out.append(f"version must look like 1.7.1.116, got {self.version!r}")
        if not self.profiles:
            out.append("profiles must not be empty")
        for cc in self.targets:
            try:
                parse_capability(cc)
            except ValueError as exc:
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
        if (self.validation is None) == (self.not_run_reason is None):
            out.append("exactly one of validation and not_run_reason must be set")
        if self.precision_walk.onnx != self.onnx or not self.precision_walk.passed:  # a failed walk fails the export
            out.append(f"the precision walk must be a passed walk of {self.onnx}")
        if self.build_seconds < 0:
            out.append(f"build_seconds must be >= 0, got {self.build_seconds!r}")
        return out

    @property
    def status(self) -> str:
        return STATUS_NOT_RUN if self.validation is None else STATUS_VALIDATED

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
        """One line: what the plan is, where it runs, and its status."""
        if self.validation is not None:
            status = f"{self.status} on {self.validation.gpu}"
        else:
            status = f"{self.status} ({self.not_run_reason})"
        return f"{self.file}: {self.label}, {len(self.profiles)} profile(s), runs on {self.runs_on()}; {status}"
