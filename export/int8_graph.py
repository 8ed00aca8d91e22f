"""``model.int8.onnx`` from the FP32 ``model.onnx``: ONNX Runtime's dynamic quantization of exactly
the planned matrices, and proof from ONNX Runtime's own profiler that integer kernels run.

The matrices are found through the exporter's name-scope metadata (:func:`mbert.export.scopes.node_scopes`):
the ``MatMul`` whose deepest module is ``layers.3.mlp.Wi`` is that matrix. Its weight must be an
initializer (the exporter writes ``W^T`` as one, so the quantizer sees a constant and quantizes it per
output channel); a planned matrix the quantizer did not turn into an integer product is an error, not
a silent FP32 fallback.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from mbert.modeling.errors import ExportError

from .int8 import S8_7BIT, Site, WeightFormat
from .scopes import node_scopes

INTEGER_OPS = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger")


def matrix_nodes(onnx_path: Path) -> dict[Site, str]:
    """Site -> name of the ``MatMul`` node computing it, for every matrix with a constant weight."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in proto.graph.initializer}
    scopes = node_scopes(proto)
    found: dict[Site, str] = {}
    for node in proto.graph.node:
        scope = scopes.get(node.name)
        if node.op_type != "MatMul" or scope is None or node.input[1] not in inits:
            continue
        site = Site(scope.layer, scope.module)
        if site in found:
            raise ExportError(f"{onnx_path}: two MatMul nodes ({found[site]}, {node.name}) claim {site.name}")
        found[site] = node.name
    return found


def quantize_graph(fp32_onnx: Path, out: Path, sites: Iterable[Site] | None, fmt: WeightFormat = S8_7BIT) -> dict:
    """Write ``out``: the matrices ``sites`` (None: every matrix with a constant weight, the blind
    way) as dynamic INT8 products with per-channel weights; everything else unchanged FP32.
    Returns what was quantized: ``{"nodes": {site: node}, "weight_format": ...}``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = matrix_nodes(fp32_onnx)
    if sites is None:
        chosen = dict(nodes)
    else:
        sites = list(sites)
        missing = [s.name for s in sites if s not in nodes]
        if missing:
            raise ExportError(f"{fp32_onnx}: no MatMul with a constant weight for {', '.join(missing)} "
                              "(the exporter's name-scope metadata does not place one there)")
        chosen = {s: nodes[s] for s in sites}
    out = Path(out)
    if not chosen:
        raise ExportError("no matrix to quantize: the INT8 plan kept every matrix FP32")
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer logs a pre-processing hint per call
    try:
        quantize_dynamic(
            str(fp32_onnx), str(out),
            op_types_to_quantize=["MatMul"],
            # exactly the planned nodes; blind (sites None): every MatMul whose B is constant
            nodes_to_quantize=list(chosen.values()) if sites is not None else None,
            per_channel=True,  # one scale per output channel (the last axis of the [K, N] initializer)
            reduce_range=fmt.reduce_range,
            weight_type=QuantType.QInt8,  # activations are always uint8 in dynamic mode
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        logging.getLogger().setLevel(level)
    done = _quantized_nodes(out)
    lost = [s.name for s, n in chosen.items() if n not in done]
    if lost:
        raise ExportError(f"{out}: ONNX Runtime's quantizer left {', '.join(lost)} in FP32")
    return {"nodes": {s.name: n for s, n in chosen.items()}, "weight_format": fmt.name,
            "reduce_range": fmt.reduce_range, "per_channel": True}


def _quantized_nodes(path: Path) -> set[str]:
    """Names of the original MatMul nodes the quantizer replaced (it names them ``<node>_quant``)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {n.name[: -len("_quant")] for n in proto.graph.node
            if n.op_type in INTEGER_OPS and n.name.endswith("_quant")}


def kernels_run(onnx_path: Path, ids: np.ndarray, mask: np.ndarray, threads: int | None = None) -> dict[str, int]:
    """Op type -> number of nodes ONNX Runtime's CPU EP actually executed for one run, read from its
    profiler (after its graph optimizations and fusions)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        opts = ort.SessionOptions()
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(d, "int8")
        if threads:
            opts.intra_op_num_threads = threads
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
