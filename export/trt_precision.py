"""Precision checked inside TensorRT's own network: does TensorRT compute each site of the FP16 plan
in the precision the plan gives it?

After parsing ``model.fp16.onnx`` (no GPU needed with TensorRT-RTX) every layer of the
``INetworkDefinition`` is placed at a precision-plan **site**, and the dtypes TensorRT will compute
in (the layers' output types; a strongly typed network keeps them) are compared with the plan.

Placing a layer. The ONNX parser writes the ONNX node a layer came from into the layer's metadata,
``[ONNX Layer: node_linear_3]`` (several nodes, separated by ASCII 0x1E/0x1F, for a fused layer);
most layers are also named after their node (``node_linear_3``, ``node_Shape_2_0``, ...). The
node's name-scope metadata (:func:`mbert.export.scopes.node_scopes`) gives the module it was traced
under, hence the site: ``layers.<i>.residual`` / ``.attention`` / ``.mlp``, ``embeddings``,
``final_norm``, ``head``. Layers the parser adds on its own (``ONNXTRT_Broadcast``, shape helpers,
``(Unnamed Layer* 8)``) carry no metadata: they take the site of the layers they connect when those
agree (consumers first, then producers), else they stay unplaced; nodes outside the encoder (the
graph wrapper, pooling, RoPE positions) are "outside".

What "a site is FP16 / FP32" means here:

* compute layers: MATRIX_MULTIPLY, ELEMENTWISE, UNARY, ACTIVATION, NORMALIZATION, SOFTMAX, REDUCE
  (and EINSUM, SCALE, CUMULATIVE); casts and data movement (shuffle, slice, gather, concat,
  constants, shapes, select) are not counted;
* the site's *defining* layers: attention, MLP and head: their matrix products (MATRIX_MULTIPLY);
  residual: the residual adds (ELEMENTWISE layers of the layer module itself); ``embeddings`` and
  ``final_norm`` (a LayerNorm, whose statistics are FP32 by design): the layers handing the site's
  result to the rest of the network;
* a site the plan keeps **FP32** passes when every defining layer is FP32 and *no* compute layer of
  the site is FP16;
* a site the plan puts in **FP16** passes when every defining layer is FP16; its other compute
  layers may be FP32 by design (softmax and LayerNorm statistics, RoPE: the plan's
  ``always_fp32``);
* a site with no defining layer, a site TensorRT has that the plan lacks, or a matrix product that
  cannot be placed fails the check.

The plan's precision of a site is the one :func:`mbert.export.precision.to_mixed_precision` applies:
``layers[i].residual/attention/mlp``, ``final_norm``; ``embeddings`` delivers into layer 0's
residual stream (its norm follows ``layers[0].residual``); heads are FP16.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbert.bundle.engine import PrecisionWalkRecord, SitePrecision
from mbert.bundle.schema import to_json
from mbert.modeling.errors import PrecisionError
from mbert.modeling.paths import check_relpath
from mbert.runtime.trt_family import resolve_family

from .precision import Plan
from .scopes import Scope, node_scopes
from .trt_build import parse_onnx

__all__ = ["SiteCheck", "PrecisionWalk", "walk_precision", "walk_network", "expected_precision"]

COMPUTE = {"MATRIX_MULTIPLY", "ELEMENTWISE", "UNARY", "ACTIVATION", "NORMALIZATION", "SOFTMAX", "REDUCE",
           "EINSUM", "SCALE", "CUMULATIVE"}
DTYPES = {"HALF": "float16", "FLOAT": "float32", "BF16": "bfloat16"}
_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]\x1e\x1f]+)\]")
OUTSIDE = "outside"
SITE_ORDER = ("embeddings", "residual", "attention", "mlp", "final_norm", "head")


@dataclass(frozen=True)
class SiteCheck:
    """One site: the plan's precision, TensorRT's, the counts behind it and the verdict."""

    site: str  # "layers.1.mlp", "embeddings", "final_norm", "head"
    layer: int | None
    group: str  # residual / attention / mlp / embeddings / final_norm / head
    plan: str  # float16 / float32
    tensorrt: str  # float16 / float32 / mixed / none: the dtype of the defining layers
    defining: str  # which layers decide: "matrix products", "residual adds", "site outputs"
    defining_fp16: int
    defining_fp32: int
    compute_fp16: int  # all compute layers of the site
    compute_fp32: int
    passed: bool
    why: str


@dataclass(frozen=True)
class PrecisionWalk:
    """The walk's result: per site checks, network-wide counts, and the overall verdict."""

    family: str
    version: str
    onnx: str
    sites: tuple[SiteCheck, ...]
    network: dict  # {"layers": n, "compute": {"float16": a, "float32": b}, "casts": c, "placed_by": {...}}
    unplaced: dict  # {"LAYER_TYPE dtype": count} of compute layers with no site
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def fp32_sites(self) -> list[str]:
        return [s.site for s in self.sites if s.tensorrt == "float32"]

    def to_dict(self) -> dict:
        """The walk as JSON, with what is derived from it: the verdict, the FP32 sites, the per-layer
        rows and the rendered table (so a reader needs no code from mbert.export)."""
        return {**to_json(self), "passed": self.passed, "fp32_sites": self.fp32_sites, "layers": self.layer_rows(),
                "table": self.table()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def record(self, file: str) -> PrecisionWalkRecord:
        """The manifest's summary of this walk, saved as ``file``."""
        compute = self.network["compute"]
        sites = tuple(SitePrecision(s.site, s.plan, s.tensorrt, s.compute_fp16, s.compute_fp32, s.passed)
                      for s in self.sites)
        return PrecisionWalkRecord(check_relpath(file, "precision walk file"), check_relpath(self.onnx, "onnx"),
                                   self.family, self.version, self.passed,
                                   compute.get("float16", 0) + compute.get("bfloat16", 0), compute.get("float32", 0),
                                   tuple(self.fp32_sites), sites, self.problems)

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PrecisionError(f"TensorRT's network disagrees with the FP16 plan ({self.onnx}): "
                                 + "; ".join(self.problems))

    def layer_rows(self) -> list[dict]:
        """Per encoder layer: plan and TensorRT precision of its three sites, and its FP16/FP32
        compute-layer counts (the per-layer summary the bundle keeps)."""
        rows: dict[int, dict] = {}
        for s in self.sites:
            if s.layer is None:
                continue
            row = rows.setdefault(s.layer, {"layer": s.layer, "fp16_layers": 0, "fp32_layers": 0, "passed": True})
            row[s.group] = {"plan": s.plan, "tensorrt": s.tensorrt}
            row["fp16_layers"] += s.compute_fp16
            row["fp32_layers"] += s.compute_fp32
            row["passed"] = row["passed"] and s.passed
        return [rows[i] for i in sorted(rows)]

    def table(self) -> list[str]:
        """The per-site table as text lines (for logs and ``mbert-run info``)."""
        lines = [f"TensorRT precision walk ({self.family} {self.version}, {self.onnx}): "
                 + ("passed" if self.passed else "FAILED"),
                 f"{'site':<22} {'plan':<8} {'tensorrt':<8} {'fp16':>5} {'fp32':>5}  verdict"]
        short = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}
        for s in self.sites:
            lines.append(f"{s.site:<22} {short.get(s.plan, s.plan):<8} {short.get(s.tensorrt, s.tensorrt):<8} "
                         f"{s.compute_fp16:>5} {s.compute_fp32:>5}  {'ok' if s.passed else 'FAIL: ' + s.why}")
        site_problems = sum(not s.passed for s in self.sites)  # walk_network lists them first
        lines += [f"problem: {p}" for p in self.problems[site_problems:]]
        return lines


def expected_precision(plan: Plan, site: str) -> str | None:
    """The precision ``plan`` gives ``site`` (see the module docstring); None for a site it lacks."""
    if site == "final_norm":
        return plan.final_norm
    if site == "embeddings":
        return plan.layers[0].residual if plan.layers else None
    if site == "head":
        return "float16"
    m = re.fullmatch(r"layers\.(\d+)\.(residual|attention|mlp)", site)
    if not m or int(m.group(1)) >= len(plan.layers):
        return None
    return getattr(plan.layers[int(m.group(1))], m.group(2))


def site_of(scope: Scope) -> str:
    if scope.layer is not None:
        return f"layers.{scope.layer}.{scope.group}"
    root = scope.module.split(".", 1)[0]
    if root in ("embeddings", "final_norm"):
        return root
    return "head"  # scope_of_path only returns encoder or head scopes


@dataclass
class _Layer:
    index: int
    name: str
    kind: str  # TensorRT LayerType name
    dtypes: tuple[str, ...]  # floating output dtypes ("float16", ...)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]  # ONNX nodes from the metadata (or the name)
    site: str | None = None
    scope: Scope | None = None


def _layers(trt: Any, network: Any, node_names: set[str]) -> list[_Layer]:
    out = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outs = [layer.get_output(j) for j in range(layer.num_outputs)]
        ins = [layer.get_input(j) for j in range(layer.num_inputs)]
        nodes = tuple(_ONNX_LAYER.findall(layer.metadata or ""))
        if not nodes and layer.name in node_names:
            nodes = (layer.name,)
        dtypes = tuple(DTYPES[t.dtype.name] for t in outs if t.dtype.name in DTYPES)
        out.append(_Layer(i, layer.name, layer.type.name, dtypes, tuple(t.name for t in ins if t is not None),
                          tuple(t.name for t in outs), nodes))
    return out


def _place(layers: list[_Layer], scopes: dict[str, Scope]) -> Counter:
    """Give each layer its site (see the module docstring); returns how many were placed how."""
    how: Counter = Counter()
    for layer in layers:
        placed = [scopes[n] for n in layer.nodes if n in scopes]
        if placed:
            layer.scope = placed[-1]
            layer.site = site_of(placed[-1])
            how["metadata"] += 1
        elif layer.nodes:
            layer.site = OUTSIDE
            how["outside"] += 1
    producer = {t: layer for layer in layers for t in layer.outputs}
    consumers: dict[str, list[_Layer]] = {}
    for layer in layers:
        for t in layer.inputs:
            consumers.setdefault(t, []).append(layer)
    changed = True
    while changed:
        changed = False
        for layer in layers:
            if layer.site is not None:
                continue
            below = {c.site for t in layer.outputs for c in consumers.get(t, []) if c.site is not None}
            above = {producer[t].site for t in layer.inputs if t in producer and producer[t].site is not None}
            for candidates in (below, above):
                if len(candidates) == 1:
                    layer.site = candidates.pop()
                    how["connected"] += 1
                    changed = True
                    break
    how["unplaced"] = sum(layer.site is None for layer in layers)
    return how


def _check_site(site: str, members: list[_Layer], plan_precision: str | None, network_outputs: set[str],
                consumers_site: dict[str, set[str]]) -> SiteCheck:
    layer_index = int(site.split(".")[1]) if site.startswith("layers.") else None
    group = site.rsplit(".", 1)[-1]
    compute = [m for m in members if m.kind in COMPUTE and m.dtypes]
    if group in ("attention", "mlp", "head"):
        defining, what = [m for m in compute if m.kind == "MATRIX_MULTIPLY"], "matrix products"
    elif group == "residual":
        defining = [m for m in compute if m.kind == "ELEMENTWISE" and m.scope is not None and m.scope.module == ""]
        what = "residual adds"
    else:
        defining = [m for m in members if m.dtypes and any(
            t in network_outputs or (consumers_site.get(t, set()) - {site}) for t in m.outputs)]
        what = "site outputs"
    dt = Counter(d for m in defining for d in m.dtypes)
    cc = Counter(d for m in compute for d in m.dtypes)
    low = cc["float16"] + cc["bfloat16"]
    tensorrt = ("none" if not dt else next(iter(dt)) if len(dt) == 1 else "mixed")
    if plan_precision is None:
        passed, why = False, "the plan has no such site"
    elif not defining:
        passed, why = False, f"no {what} found in TensorRT's network"
    elif plan_precision == "float32" and (tensorrt != "float32" or low):
        culprits = [f"{m.name} ({m.kind})" for m in compute if set(m.dtypes) - {"float32"}][:3]
        passed, why = False, f"the plan keeps it FP32 but {low} compute layer(s) are FP16: {', '.join(culprits)}"
    elif plan_precision == "float16" and tensorrt != "float16":
        culprits = [f"{m.name}" for m in defining if set(m.dtypes) != {"float16"}][:3]
        passed, why = False, f"the plan puts it in FP16 but its {what} are {tensorrt}: {', '.join(culprits)}"
    else:
        passed, why = True, ""
    return SiteCheck(site, layer_index, group, plan_precision or "none", tensorrt, what, dt["float16"],
                     dt["float32"], low, cc["float32"], passed, why)


def _site_key(site: str) -> tuple:
    if site.startswith("layers."):
        _, i, group = site.split(".")
        return (1, int(i), SITE_ORDER.index(group))
    return ({"embeddings": 0, "final_norm": 2, "head": 3}[site], 0, 0)


def walk_network(trt: Any, network: Any, proto: Any, plan: Plan, *, family: str = "", version: str = "",
                 onnx_name: str = "") -> PrecisionWalk:
    """The walk over a parsed ``network`` (``trt``: its module) of the ONNX model ``proto``."""
    scopes = node_scopes(proto)
    layers = _layers(trt, network, {n.name for n in proto.graph.node})
    how = _place(layers, scopes)
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    consumers_site: dict[str, set[str]] = {}
    for layer in layers:
        for t in layer.inputs:
            consumers_site.setdefault(t, set()).add(layer.site or "")
    by_site: dict[str, list[_Layer]] = {}
    for layer in layers:
        if layer.site not in (None, OUTSIDE):
            by_site.setdefault(layer.site, []).append(layer)
    wanted = {"embeddings", "final_norm"} | {f"layers.{i}.{g}" for i in range(len(plan.layers))
                                             for g in ("residual", "attention", "mlp")}
    checks = [_check_site(site, by_site.get(site, []), expected_precision(plan, site), outputs, consumers_site)
              for site in sorted(wanted | set(by_site), key=_site_key)]
    problems = [f"{c.site}: {c.why}" for c in checks if not c.passed]
    compute = [layer for layer in layers if layer.kind in COMPUTE and layer.dtypes]
    unplaced = Counter(f"{layer.kind} {'/'.join(layer.dtypes)}" for layer in compute if layer.site is None)
    lost = [layer.name for layer in compute if layer.site is None and layer.kind == "MATRIX_MULTIPLY"]
    if lost:
        problems.append(f"{len(lost)} matrix product(s) could not be placed at a site: {', '.join(lost[:3])}")
    counts = Counter(d for layer in compute for d in layer.dtypes)
    network_info = {"layers": len(layers), "compute": dict(sorted(counts.items())),
                    "casts": sum(layer.kind == "CAST" for layer in layers), "placed_by": dict(how)}
    return PrecisionWalk(family, version, onnx_name, tuple(checks), network_info, dict(unplaced), tuple(problems))


def walk_precision(onnx_path: str | Path, plan: Plan, *, family: str = "auto") -> PrecisionWalk:
    """Parse ``onnx_path`` with ``family``'s ONNX parser (``auto``: the builder :func:`resolve_family`
    picks) and walk it against ``plan`` (see the module docstring). TensorRT-RTX parses without a
    GPU; datacenter TensorRT's builder needs one."""
    import onnx  # noqa: PLC0415

    parsed = parse_onnx(onnx_path, resolve_family(family).family)
    proto = onnx.load(str(onnx_path), load_external_data=False)
    return walk_network(parsed.trt, parsed.network, proto, plan, family=parsed.family, version=parsed.version,
                        onnx_name=Path(onnx_path).name)
