"""Precision checked inside TensorRT's own network: does TensorRT compute each site of the FP16 plan
in the precision the plan gives it?

After parsing ``model.fp16.onnx`` (no GPU needed with TensorRT-RTX) every layer of the
``INetworkDefinition`` is placed at a precision-plan **site**, and the dtypes TensorRT will compute
in (the layers' output types; a strongly typed network keeps them) are compared with the plan.

Placing a layer. The ONNX parser writes the ONNX node a layer came from into the layer's metadata,
``[ONNX Layer: node_linear_3]`` (several nodes, separated by ASCII 0x1E/0x1F, for a fused layer);
most layers are also named after their node (``node_linear_3``, ``node_Shape_2_0``, ...). The
node's name-scope metadata (:func:`mbert.export.onnx.scopes.node_scopes`) gives the module it was traced
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

The plan's precision of a site is the one :func:`mbert.export.fp16.precision.to_mixed_precision` applies:
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

from mbert.bundle.engine import NetworkCounts, PrecisionWalk, SiteCheck
from mbert.bundle.names import PRECISION_WALK
from mbert.export.fp16.precision import Plan
from mbert.export.onnx.scopes import Scope, node_scopes
from mbert.export.tensorrt.build import ParsedNetwork, parse_onnx
from mbert.runtime.backends.family import resolve_family

__all__ = ["walk_precision", "walk_parsed", "save_walk", "expected_precision", "PRECISION_WALK"]


COMPUTE = {"MATRIX_MULTIPLY", "ELEMENTWISE", "UNARY", "ACTIVATION", "NORMALIZATION", "SOFTMAX", "REDUCE",
           "EINSUM", "SCALE", "CUMULATIVE"}
DTYPES = {"HALF": "float16", "FLOAT": "float32", "BF16": "bfloat16"}
_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]\x1e\x1f]+)\]")
OUTSIDE = "outside"
SITE_ORDER = ("embeddings", "residual", "attention", "mlp", "final_norm", "head")


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


def walk_parsed(parsed: ParsedNetwork, plan: Plan, *, file: str = PRECISION_WALK) -> tuple[PrecisionWalk, list[dict]]:
    """The walk over a parsed network against ``plan`` (see the module docstring), and every TensorRT
    layer with its site and dtypes (what ``file`` holds: :func:`save_walk`)."""
    import onnx  # noqa: PLC0415

    proto = onnx.load(str(parsed.source), load_external_data=False)
    network = parsed.network
    layers = _layers(parsed.trt, network, {n.name for n in proto.graph.node})
    how = _place(layers, node_scopes(proto))
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
    network_counts = NetworkCounts(len(layers), counts["float16"], counts["bfloat16"], counts["float32"],
                                   sum(layer.kind == "CAST" for layer in layers), how["metadata"], how["connected"],
                                   how["outside"], how["unplaced"])
    walk = PrecisionWalk(file, parsed.source.name, parsed.family, parsed.version, tuple(checks), network_counts,
                         dict(sorted(unplaced.items())), tuple(problems))
    listing = [{"index": layer.index, "name": layer.name, "type": layer.kind, "dtypes": list(layer.dtypes),
                "site": layer.site, "onnx_nodes": list(layer.nodes)} for layer in layers]
    return walk, listing


def save_walk(path: str | Path, walk: PrecisionWalk, listing: list[dict]) -> None:
    """``tensorrt_precision.json``: the verdict, the per-site table and every TensorRT layer with its
    site (the manifest's engine record holds the walk itself)."""
    data = {"onnx": walk.onnx, "tensorrt": f"{walk.family} {walk.version}", "passed": walk.passed,
            "problems": list(walk.problems), "table": walk.table(), "layers": listing}
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def walk_precision(onnx_path: str | Path, plan: Plan, *, family: str = "auto") -> PrecisionWalk:
    """Parse ``onnx_path`` with ``family``'s ONNX parser (``auto``: the builder :func:`resolve_family`
    picks) and walk it against ``plan`` (see the module docstring). TensorRT-RTX parses without a
    GPU; datacenter TensorRT's builder needs one."""
    return walk_parsed(parse_onnx(onnx_path, resolve_family(family).family), plan)[0]
