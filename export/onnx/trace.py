"""Trace the eager model to ONNX with dynamic ``batch`` and ``sequence`` axes.

The graph is the eager model itself (``mbert.modeling.model``), traced with the torch.export-based
exporter, plus the checkpoint's sentence-transformers pooling for embedding checkpoints, so C++ and
Triton callers get ``sentence_embedding`` without post-processing.

Opset 18. The graph needs opset 17 for a native ``LayerNormalization`` (TensorRT maps it to its
normalization layer; a decomposed ReduceMean/Pow/Sqrt LayerNorm triggers TensorRT's FP16 overflow
warning and runs slower, and ONNX Runtime runs it as one fused kernel). But torch's exporter
(2.13) writes its translations for opset 18 and its down-conversion to 17 fails on ``Pad``
("No Adapter To Version 17 for Pad", measured), so 18 is the lowest opset it produces. Opset 18
loads in TensorRT 10.x/11.x and ONNX Runtime 1.14+. ``--opset`` may raise it; the manifest records
the opset read back from the written file.

One trace, several targets: attention is the custom op ``mbert::attention``, kept whole by
``torch.export`` and translated per target (``mbert.export.onnx.lowering``): ``onnxruntime`` (fused
``com.microsoft.MultiHeadAttention`` in global layers; ONNX Runtime only) or ``tensorrt`` (standard
ops in TensorRT's attention-fusion pattern; every runtime). ``export_targets`` captures the model
once and reuses torch.export's program for every further target (the capture is ~30% of a trace).

What was measured when choosing the formulation (2 cores, ONNX Runtime 1.32 CPU, full-size
ModernBERT-base, random weights; ``benchmarks/results/onnx_cpu.md``):

* Local layers are blocked (see ``model.Attention._local``): the band-masked formulation needs a
  [B, H, T, T] score tensor in every layer; blocks of ``local_attention // 2`` keep local layers
  at [B, H, T/64, 64, 192], linear in T. Local layers are ~1% of the 1 x 8192 profile. The block
  count is ``ceil(T / w)`` written so that ``nb * w == T + pad`` holds symbolically (the tracer
  then proves no remainder identities: less symbolic-shape work per traced layer).
* Masks are an additive FP32 bias: with ``Where`` (select) masking, ONNX Runtime's broadcasting
  Where took 47% of a 1 x 8192 forward (24 s of 52 s in its profiler).
* Global layers run in MultiHeadAttention's flash kernel in the ONNX Runtime form, which never
  materializes the scores: in standard ops all heads at once peak at 15.5 GB RSS at 1 x 8192, and
  one head at a time at 3.9 GB and 38.5 s against the fused 35.3 s, 2.06 GiB
  (``benchmarks/results/onnx_cpu.md``; measurements in ``mbert.export.onnx.lowering``).
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from mbert.bundle.errors import ExportError
from mbert.bundle.pooling import PoolingConfig
from mbert.bundle.tensors import TensorSpec, input_specs
from mbert.export.onnx.lowering import TARGETS, translation_table
from mbert.export.progress import Meter, ProgressFn
from mbert.modeling.graph import GraphModule

OPSET = 18
MIN_OPSET = 18  # see the module docstring
PROTOBUF_LIMIT = 2 * 1024**3  # a single .onnx file cannot exceed 2 GiB: bigger weights go to external data
# The tracer specializes an axis whose example size is 1 (torch.export's 0/1 specialization): the
# sequence axis needs an example of at least 2 tokens, and the example cannot exceed the axis' range.
MIN_SEQ_LEN = 2


def _check_target(target: str, opset: int) -> None:
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is too low: LayerNormalization needs 17 and torch's exporter "
                          f"writes {MIN_OPSET} or newer")
    if target not in TARGETS:
        raise ExportError(f"unknown ONNX target {target!r}: choose one of {', '.join(TARGETS)}")


def export_targets(
    model: nn.Module,
    paths: Mapping[str, str | Path],
    *,
    pooling: PoolingConfig | None = None,
    opset: int = OPSET,
    max_seq_len: int | None = None,
    progress: ProgressFn | None = None,
) -> tuple[TensorSpec, ...]:
    """Trace ``model`` (FP32 or mixed precision) once and write one ONNX file per target.

    ``paths``: target -> file. ``tensorrt``: standard ONNX ops only (every runtime loads it);
    ``onnxruntime``: fused attention through ONNX Runtime's contrib ops (ONNX Runtime only); see
    ``mbert.export.onnx.lowering``. Returns the graphs' I/O specs (the same for every target).
    """
    if not paths:
        raise ExportError("export_targets needs at least one target")
    for target in paths:
        _check_target(target, opset)
    graph = GraphModule(model, pooling).eval()
    cfg = model.config
    max_seq_len = cfg.max_position_embeddings if max_seq_len is None else max_seq_len
    if max_seq_len < MIN_SEQ_LEN:
        raise ExportError(f"max_seq_len {max_seq_len} is below {MIN_SEQ_LEN}: the tracer needs an example of at "
                          "least 2 tokens to keep the sequence axis dynamic")
    # Example shapes distinct from every static dim, so the tracer cannot confuse them.
    example_len = min(max_seq_len, 2 * cfg.window_half_width + 3)
    ids = torch.full((2, example_len), cfg.pad_token_id, dtype=torch.int64)
    ids[:, 0] = cfg.cls_token_id if cfg.cls_token_id is not None else 0
    mask = torch.ones_like(ids)
    mask[1, example_len // 2 :] = 0
    device = next(model.parameters()).device
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=max(max_seq_len, 2))
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = n_bytes > PROTOBUF_LIMIT - 64 * 1024**2
    # progress weights: tracing is ~85% of a target's time, saving and checking the file the rest
    # (full-size base: 41 + 2 s of trace and optimization, 6 s save, 4 s checks)
    meter = Meter("trace", 10 * len(paths), progress)
    captured = None  # torch.export's program, captured by the first target and reused by the others
    for target, path in paths.items():
        path = Path(path)
        try:
            with warnings.catch_warnings(), _quiet_loggers("torch.onnx", "onnxscript", "torch.export"):
                warnings.simplefilter("ignore")
                program = torch.onnx.export(
                    graph if captured is None else captured,
                    (ids.to(device), mask.to(device)) if captured is None else (),
                    None,
                    input_names=[s.name for s in input_specs()],
                    output_names=list(graph.output_names),
                    opset_version=opset,
                    dynamo=True,
                    dynamic_shapes=dynamic if captured is None else None,
                    custom_translation_table=translation_table(target),
                    optimize=False,  # optimize() below: the default optimizer's passes, fewer rewrite rules
                    verbose=False,
                )
                optimize(program.model)
        except Exception as exc:  # the exporter raises many types; all mean the trace failed
            raise ExportError(f"tracing {cfg.source} to ONNX ({target}) failed: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from exc
        captured = program.exported_program
        meter.advance(8, f"{target}: traced, translated and optimized")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            program.save(str(path), external_data=external)
        except OSError as exc:  # onnx's save names no file: a full disk is this file's, say so
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc
        meter.advance(1, f"{target}: saved {path.name}")
        check_graph(path)
        check_dynamic_axes(path)
        meter.advance(1, f"{target}: checked {path.name}")
    return input_specs() + graph.output_specs()


def to_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    pooling: PoolingConfig | None = None,
    opset: int = OPSET,
    max_seq_len: int | None = None,
    target: str = "tensorrt",
    progress: ProgressFn | None = None,
) -> tuple[TensorSpec, ...]:
    """Export ``model`` (FP32 or mixed precision) to ``path`` for ``target``; returns the graph's I/O specs."""
    return export_targets(model, {target: path}, pooling=pooling, opset=opset, max_seq_len=max_seq_len,
                          progress=progress)


def check_dynamic_axes(path: str | Path) -> None:
    """Every input of the written graph has symbolic batch and sequence axes (never a fixed size)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.input:
        dims = [d.dim_param or d.dim_value for d in tensor.type.tensor_type.shape.dim]
        if len(dims) != 2 or not all(isinstance(d, str) and d for d in dims):
            raise ExportError(f"{path}: input {tensor.name!r} has shape {dims}; its batch and sequence axes must "
                              "be dynamic, the graph is not written")


# The rewrite rules of onnxscript's default optimizer that apply to this model's graphs; the others
# look for Conv, BatchNorm, Clip, Scatter, Gemm, ... patterns it does not have. Matching all of them
# took 29 s of a 73 s trace of full-size ModernBERT-base; with these it takes 2 s, and the graph
# differs from the default's by 3 shape nodes (measured with onnxscript 0.7.2).
def _rules():
    from onnxscript.rewriter.rules import common as r

    return [r.cast_cast_rule, r.no_op_cast_rule, r.no_op_expand_rule, r.reshape_reshape_rule, r.no_op_transpose_rule,
            r.transpose_transpose_rule, r.unsqueeze_unsqueeze_rule]


def optimize(model) -> None:
    """onnxscript's default optimization in place (functions inlined, constants folded with shape
    inference, rewrites, dead code removed, constants lifted to initializers, duplicates merged,
    common subexpressions eliminated), with the rewrite rules of :func:`_rules` only."""
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants_ir
    from onnxscript.rewriter import RewritePass

    class FoldConstants(ir.passes.InPlacePass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=bool(fold_constants_ir(model, onnx_shape_inference=True)))

    rounds = [FoldConstants(), RewritePass(_rules()), common.RemoveUnusedNodesPass()]
    ir.passes.Sequential(
        common.InlinePass(), *rounds, *rounds,  # two rounds, as the default optimizer runs
        common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass(),
    )(model)


def graph_opset(path: str | Path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """The exporter logs warnings about unrelated packages (torchvision ops); keep the CLI readable."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def check_graph(path: str | Path) -> None:
    """The ONNX checker passes, and no initializer or constant holds an infinity or NaN."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    path = Path(path)
    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:
        raise ExportError(f"{path}: ONNX checker rejected the graph: {_first_line(exc)}") from exc
    proto = onnx.load(str(path))
    bad = []
    for init in proto.graph.initializer:
        arr = numpy_helper.to_array(init, base_dir=str(path.parent))
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            bad.append(f"initializer {init.name}")
    for node in proto.graph.node:
        if node.op_type in ("Constant", "ConstantOfShape"):
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    arr = numpy_helper.to_array(attr.t)
                    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                        bad.append(f"constant {node.name}")
                elif attr.type == onnx.AttributeProto.FLOAT and not math.isfinite(attr.f):
                    bad.append(f"constant {node.name}")
    if bad:
        raise ExportError(f"{path}: non-finite constants in the graph: {', '.join(bad[:10])}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
