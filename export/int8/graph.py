"""INT8 graphs from the FP32 ``model.onnx``, and proof from ONNX Runtime's own profiler that integer
kernels run.

:func:`write_int8` replaces each chosen ``MatMul`` by one ``com.microsoft.DynamicQuantizeMatMul``:
the node ONNX Runtime's CPU EP fuses ``quantize_dynamic``'s output (DynamicQuantizeLinear +
MatMulInteger + Cast + Mul) into, with the weights ``quantize_dynamic`` would write (per output
channel, symmetric, :func:`mbert.export.int8.plan.quantize_weight`). ``tests/test_int8.py`` proves the
two graphs give bit-identical outputs in ONNX Runtime for both weight formats, so this is ONNX
Runtime's dynamic quantization, written in seconds: ``quantize_dynamic`` quantizes per channel in a
Python loop (~50 s for ModernBERT-base's 88 matrices on this 2-core machine), too slow for a plan
that builds and checks several candidate graphs. :func:`quantize_graph` (``quantize_dynamic``
itself) stays as the reference the tests compare with.

The matrices are found through the exporter's name-scope metadata (:func:`mbert.export.onnx.scopes.node_scopes`):
the ``MatMul`` whose deepest module is ``layers.3.mlp.Wi`` is that matrix; its weight must be an
initializer (the exporter writes ``W^T`` as one).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from mbert.bundle.errors import ExportError
from mbert.bundle.files import replacing
from mbert.export.int8.plan import S8_7BIT, Site, WeightFormat, quantize_weight
from mbert.export.onnx.scopes import node_scopes

INTEGER_OPS = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger")
MS_DOMAIN = "com.microsoft"


def matrix_nodes(onnx_path: Path) -> dict[Site, str]:
    """Site -> name of the ``MatMul`` node computing it, for every matrix with a constant weight."""
    import onnx

    return _matrix_nodes(onnx.load(str(onnx_path), load_external_data=False), onnx_path)


def _matrix_nodes(proto, where) -> dict[Site, str]:
    inits = {i.name for i in proto.graph.initializer}
    scopes = node_scopes(proto)
    found: dict[Site, str] = {}
    for node in proto.graph.node:
        scope = scopes.get(node.name)
        if node.op_type != "MatMul" or scope is None or node.input[1] not in inits:
            continue
        site = Site(scope.layer, scope.module)
        if site in found:
            raise ExportError(f"{where}: two MatMul nodes ({found[site]}, {node.name}) claim {site.name}")
        found[site] = node.name
    return found


def _chosen(nodes: dict[Site, str], sites: Iterable[Site] | None, where) -> dict[Site, str]:
    if sites is None:
        return dict(nodes)
    sites = list(sites)
    missing = [s.name for s in sites if s not in nodes]
    if missing:
        raise ExportError(f"{where}: no MatMul with a constant weight for {', '.join(missing)} "
                          "(the exporter's name-scope metadata does not place one there)")
    if not sites:
        raise ExportError("no matrix to quantize: the INT8 plan kept every matrix FP32")
    return {s: nodes[s] for s in sites}


def write_int8(fp32_onnx: Path, out: Path, sites: Iterable[Site] | None, fmt: WeightFormat = S8_7BIT) -> dict:
    """Write ``out``: the matrices ``sites`` (None: every matrix with a constant weight, the blind way)
    as ``DynamicQuantizeMatMul`` with per-channel int8 weights of ``fmt``; everything else unchanged.
    Returns what was quantized: ``{"nodes": {site: node}, "weight_format": ...}``."""
    import onnx
    import torch
    from onnx import helper, numpy_helper

    proto = onnx.load(str(fp32_onnx))
    chosen = _chosen(_matrix_nodes(proto, fp32_onnx), sites, fp32_onnx)
    inits = {i.name: i for i in proto.graph.initializer}
    wanted = set(chosen.values())
    nodes, replaced = [], set()
    for node in proto.graph.node:
        if node.name not in wanted:
            nodes.append(node)
            continue
        x, w_name = node.input
        w_t = numpy_helper.to_array(inits[w_name])  # [K, N] = W^T
        q, scale = quantize_weight(torch.from_numpy(np.ascontiguousarray(w_t.T)), fmt)  # per output channel n
        base = node.name
        proto.graph.initializer.extend([
            numpy_helper.from_array(q.numpy().T.astype(np.int8), f"{base}_W_int8"),
            numpy_helper.from_array(scale.numpy().astype(np.float32), f"{base}_W_scale"),
            numpy_helper.from_array(np.zeros(scale.shape, dtype=np.int8), f"{base}_W_zero_point")])
        nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, f"{base}_W_int8", f"{base}_W_scale",
                                                                 f"{base}_W_zero_point"],
                                      list(node.output), name=f"{base}_quant", domain=MS_DOMAIN))
        replaced.add(w_name)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    still_used = {i for n in proto.graph.node for i in n.input}
    keep = [i for i in proto.graph.initializer if i.name not in replaced or i.name in still_used]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    _save(proto, Path(out))
    return {"nodes": {s.name: n for s, n in chosen.items()}, "weight_format": fmt.name,
            "reduce_range": fmt.reduce_range, "per_channel": True, "writer": "DynamicQuantizeMatMul"}


def _save(proto, out: Path) -> None:
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        onnx.save(proto, str(tmp))


def quantize_graph(fp32_onnx: Path, out: Path, sites: Iterable[Site] | None, fmt: WeightFormat = S8_7BIT) -> dict:
    """The same graph through ONNX Runtime's own ``quantize_dynamic`` (the reference :func:`write_int8`
    is tested against; slow: see the module docstring)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = matrix_nodes(fp32_onnx)
    chosen = _chosen(nodes, sites, fp32_onnx)
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer logs a pre-processing hint per call
    try:
        quantize_dynamic(
            str(fp32_onnx), str(out),
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=list(chosen.values()) if sites is not None else None,
            per_channel=True,  # one scale per output channel (the last axis of the [K, N] initializer)
            reduce_range=fmt.reduce_range,
            weight_type=QuantType.QInt8,  # activations are always uint8 in dynamic mode
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        logging.getLogger().setLevel(level)
    import onnx

    proto = onnx.load(str(out), load_external_data=False)
    done = {n.name[: -len("_quant")] for n in proto.graph.node if n.op_type in INTEGER_OPS and n.name.endswith("_quant")}
    lost = [s.name for s, n in chosen.items() if n not in done]
    if lost:
        raise ExportError(f"{out}: ONNX Runtime's quantizer left {', '.join(lost)} in FP32")
    return {"nodes": {s.name: n for s, n in chosen.items()}, "weight_format": fmt.name,
            "reduce_range": fmt.reduce_range, "per_channel": True, "writer": "quantize_dynamic"}


def kernels_run(onnx_path: Path, ids: np.ndarray, mask: np.ndarray, threads: int | None = None) -> dict[str, int]:
    """Op type -> number of nodes ONNX Runtime's CPU EP actually executed for one run, read from its
    profiler (after its graph optimizations and fusions)."""
    import onnxruntime as ort

    from mbert.runtime.backends.onnxruntime import session_options

    with tempfile.TemporaryDirectory() as d:
        opts = session_options(threads)  # the runtime's: the kernels it will run
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(d, "int8")
        session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        session.run(None, {"input_ids": ids, "attention_mask": mask})
        events = json.loads(Path(session.end_profiling()).read_text())
    counts: dict[str, int] = {}
    seen = set()
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if e["name"] in seen:
            continue
        seen.add(e["name"])
        op = e.get("args", {}).get("op_name", "?")
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def integer_matmuls(counts: dict[str, int]) -> int:
    return sum(counts.get(op, 0) for op in INTEGER_OPS)
