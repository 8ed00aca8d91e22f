"""The INT8 stages of the pipeline (``mbert-export --int8``), after the FP32 graph is validated:

* :func:`sensitivity`: each matrix quantized alone, emulated on the calibration rows (plan step 1);
* :func:`choose`: the emulated combined damage picks a set within budget, ONNX Runtime builds and
  checks it end to end on the grid and the retrieval check, fewer matrices until one passes (steps 2
  and 3); the set that passed is ``model.int8.onnx``, its check the graph's validation;
* :func:`finish`: proof from ONNX Runtime's profiler that integer kernels run, the blind
  quantizations on the same checks (reported), ``int8.json``, ``int8.png`` and the records.

See :mod:`mbert.export.int8.plan` for the arithmetic and the plan, :mod:`mbert.export.int8.check` for the
checks.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mbert.bundle import GraphRecord, Int8Record, MatrixPlan
from mbert.bundle.errors import ExportError
from mbert.bundle.names import FP32_GRAPH, INT8_GRAPH, INT8_PLAN, INT8_PLOT
from mbert.bundle.schema import to_json
from mbert.bundle.tensors import Runner
from mbert.bundle.validation import tolerances_for
from mbert.export.context import Context
from mbert.export.int8.check import GraphCheck, RetrievalSet, blind_reports, check_graph, retrieval_set
from mbert.export.int8.graph import integer_matmuls, kernels_run, matrix_nodes, write_int8
from mbert.export.int8.plan import (
    S8_7BIT,
    SOLO_LEN,
    Reference,
    Selection,
    SensitivityReport,
    Site,
    budget_for,
    calibration_batches,
    combined_damage,
    finite_or_none,
    fp32_reference,
    matrix_sites,
    measure,
    select,
)
from mbert.export.onnx.trace import graph_opset
from mbert.export.progress import Meter, case_progress
from mbert.runtime.backends.onnxruntime import onnx_runner

FMT = S8_7BIT


@dataclass(frozen=True)
class Sensitivity:
    reference: Reference
    report: SensitivityReport
    not_in_graph: tuple[Site, ...]  # matrices model.onnx does not compute as a MatMul with a constant weight
    seconds: dict[str, float]


@dataclass(frozen=True)
class Chosen:
    sensitivity: Sensitivity
    selection: Selection
    check: GraphCheck  # the end-to-end check of model.int8.onnx (passed)
    retrieval: RetrievalSet | None
    graph_info: dict  # quantized nodes and weight format
    seconds: dict[str, float]


@dataclass(frozen=True)
class Int8Outcome:
    graph: GraphRecord
    record: Int8Record


def sensitivity(ctx: Context) -> Sensitivity:
    t0 = time.perf_counter()
    graph = ctx.graph
    in_graph = matrix_nodes(ctx.staging / FP32_GRAPH)
    sites = [s for s, _ in matrix_sites(ctx.model)]
    ref = fp32_reference(graph, calibration_batches(ctx.tokenizer, ctx.texts))
    t1 = time.perf_counter()
    meter = Meter("int8 sensitivity", 1.0, ctx.progress)
    report = measure(graph, ref, [s for s in sites if s in in_graph], FMT,
                     lambda done, total: meter.advance(1.0 / total, f"{done}/{total} matrix passes"))
    return Sensitivity(ref, report, tuple(s for s in sites if s not in in_graph),
                       {"fp32 reference": t1 - t0, "solo": report.seconds})


def choose(ctx: Context, reference: Runner, sens: Sensitivity) -> Chosen:
    """Steps 2 and 3: the largest cheapest-first set within budget that passes end to end."""
    from mbert.bundle.texts import calibration_texts

    t0 = time.perf_counter()
    cfg, names = ctx.model.config, ctx.graph.output_names
    fp32, tolerances = ctx.staging / FP32_GRAPH, tolerances_for("int8", names)
    # The FP32 side of the retrieval check runs on model.onnx, just validated against the eager model
    # (cosine >= 0.99999 on the grid) and faster than it on CPU; the grid's references are the eager
    # model's, already computed for that validation.
    retrieval = retrieval_set(ctx.tokenizer, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id, ctx.max_len,
                              onnx_runner(fp32), names)
    t_ret = time.perf_counter() - t0
    passed: dict[int, tuple[Path, GraphCheck, dict]] = {}
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=ctx.staging) as d:
        meter = Meter("int8 plan", 0, ctx.progress)  # the number of candidates is found as it goes

        def end_to_end(sites: Sequence[Site]) -> tuple[bool, str]:
            path = Path(d) / f"candidate-{len(sites)}.onnx"
            info = write_int8(fp32, path, sites, FMT)
            check = check_graph(INT8_GRAPH, path, reference, ctx.cases, tolerances, retrieval, fail_fast=True)
            if check.passed:
                passed[len(sites)] = (path, check, info)
            else:
                path.unlink()
            meter.advance(1, f"{len(sites)} INT8 matrices end to end: {'passed' if check.passed else 'missed'}")
            return check.passed, check.detail()

        graph = ctx.graph
        selection = select(sens.report, budget_for(names), lambda s: combined_damage(graph, sens.reference, s, FMT),
                           end_to_end)
        path, check, info = passed[len(selection.chosen)]
        os.replace(path, ctx.staging / INT8_GRAPH)
    return Chosen(sens, selection, check, retrieval, info, {"retrieval reference": t_ret, **selection.seconds})


def finish(ctx: Context, reference: Runner, chosen: Chosen) -> Int8Outcome:
    """Kernels proof, blind quantizations, int8.json, int8.png; the graph and INT8 records."""
    from mbert.export.int8.plot import plot_int8

    t0 = time.perf_counter()
    path, probe = ctx.staging / INT8_GRAPH, ctx.cases[0]
    kernels = kernels_run(path, probe.input_ids, probe.attention_mask)
    ran, want = integer_matmuls(kernels), len(chosen.selection.chosen)
    if ran < want:
        raise ExportError(f"{INT8_GRAPH}: ONNX Runtime's profiler saw {ran} integer matrix products for {want} "
                          f"quantized matrices (kernels: {kernels})")
    names = ctx.graph.output_names
    blind = blind_reports(ctx.staging / FP32_GRAPH, reference, ctx.cases, tolerances_for("int8", names),
                          chosen.retrieval,
                          lambda name: case_progress(f"int8 blind ({name})", ctx.model.config, ctx.cases, ctx.progress))
    sens, sel = chosen.sensitivity, chosen.selection
    report = sens.report
    matrices = sel.matrices + tuple(_not_in_graph(s) for s in sens.not_in_graph)
    calibration = (f"{report.rows} calibration rows x {SOLO_LEN} tokens, one batch, "
                   f"{report.fmt} weights")
    seconds = {**sens.seconds, **chosen.seconds, "kernels and blind": time.perf_counter() - t0}
    record = Int8Record(
        plan=INT8_PLAN, plot=INT8_PLOT, weight_format=report.fmt, budget=budget_for(names), calibration=calibration,
        matrices=matrices, combined_damage={k: finite_or_none(v) for k, v in sel.combined.items()}, checks=sel.checks,
        retrieval=chosen.check.retrieval, integer_kernels=ran, blind=blind,
        seconds={k: round(v, 2) for k, v in seconds.items()})
    details = {"record": to_json(record), "graph": dict(chosen.graph_info, kernels=kernels),
               "weight_format_note": FMT.note}
    (ctx.staging / INT8_PLAN).write_text(json.dumps(details, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    plot_int8(matrices, record.budget, calibration, ctx.staging / INT8_PLOT)
    graph = GraphRecord(INT8_GRAPH, "int8", ("onnxruntime",), graph_opset(path), chosen.check.validation)
    return Int8Outcome(graph, record)


def _not_in_graph(site: Site) -> MatrixPlan:
    return MatrixPlan(site.name, site.layer, site.module, {}, "fp32",
                      "not a MatMul with a constant weight in model.onnx (ONNX Runtime's quantizer cannot take it)")
