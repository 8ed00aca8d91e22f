"""The export pipeline: load, trace, validate, [scan, plan, mixed precision, validate FP16, engine],
Triton repository, write. Each stage is one of the composable steps of ``mbert.export``; this module
only sequences them, reports progress, and writes the bundle atomically.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from mbert.modeling import load_model, load_pooling
from mbert.modeling.errors import ExportError

from . import bundle as bundle_mod
from .onnx import GraphModule, OPSET, to_onnx
from .texts import calibration_texts, load_text_file
from .validate import FP32_TOLERANCE, build_cases, compare, default_grid, eager_runner, load_tokenizer, onnx_runner

Reporter = Callable[[str, str], None]  # (event, message); events: "stage", "done", "info", "warn"


@dataclass
class ExportOptions:
    out: Path | None = None
    max_seq_len: int | None = None
    opset: int = OPSET
    overwrite: bool = False
    task: str | None = None
    fp16: bool = False
    calibration: Path | None = None
    margin: float = 8.0
    max_batch: int = 32
    opt_batch: int | None = None
    opt_seq_len: int | None = None
    split_seq: list[int] | None = None
    workspace_gib: float = 4.0
    engine: bool = True  # try TensorRT when --fp16


@dataclass
class ExportResult:
    bundle: Path
    manifest: dict
    timings: dict[str, float] = field(default_factory=dict)
    scan_rows: list = field(default_factory=list)
    plan: dict | None = None  # the FP16 plan (Plan.to_dict()), with --fp16
    engine_note: str = ""


def default_out(source: str | Path) -> Path:
    name = Path(str(source).rstrip("/")).name or "model"
    return Path("engines") / name


class _Stages:
    def __init__(self, report: Reporter, total: int):
        self.report, self.total, self.n, self.timings = report, total, 0, {}

    def run(self, name: str, fn, *args, **kwargs):
        self.n += 1
        self.report("stage", f"[{self.n}/{self.total}] {name}")
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        self.timings[name] = time.perf_counter() - t0
        self.report("done", f"{name}: {self.timings[name]:.1f}s")
        return result


def export_bundle(source: str | Path, options: ExportOptions, report: Reporter = lambda e, m: None) -> ExportResult:
    """Export ``source`` (hub id or folder) to a validated bundle; returns its path and manifest."""
    out = Path(options.out) if options.out else default_out(source)
    stages = _Stages(report, 8 if options.fp16 else 4)
    with bundle_mod.staging(out, options.overwrite) as tmp:
        model, pooling, tokenizer, max_len = stages.run("load", _load, source, options)
        cfg = model.config
        io = stages.run("trace", to_onnx, model, tmp / "model.onnx", pooling=pooling, opset=options.opset,
                        max_seq_len=max_len)
        texts = calibration_texts()
        if options.calibration:
            texts = texts + load_text_file(options.calibration)
        cases = build_cases(tokenizer, texts, default_grid(cfg.window_half_width, max_len),
                            cfg.cls_token_id, cfg.sep_token_id, cfg.pad_token_id)
        graph = GraphModule(model, pooling).eval()
        reference = eager_runner(graph)
        tolerances = {name: FP32_TOLERANCE for name in graph.output_names}
        fp32_report = stages.run("validate", lambda: compare(
            "model.onnx", onnx_runner(tmp / "model.onnx"), reference, cases, tolerances))
        fp32_report.raise_if_failed()
        manifest = _manifest(source, model, pooling, io, max_len, options)
        manifest["validation"] = {"model.onnx": fp32_report.to_dict()}
        result = ExportResult(out, manifest)
        if options.fp16:
            from . import fp16 as fp16_mod

            fp16_out = fp16_mod.run_fp16(model, pooling, tokenizer, texts, cases, reference, tmp, max_len,
                                         options, stages)
            manifest["validation"]["model.fp16.onnx"] = fp16_out.validation
            manifest["precision"] = fp16_out.summary
            manifest["engine"] = fp16_out.engine
            result.scan_rows, result.engine_note = fp16_out.scan_rows, fp16_out.engine_note
            result.plan = fp16_out.plan
        stages.run("write", _write, source, tmp, manifest, options)
        result.manifest = json.loads((tmp / bundle_mod.MANIFEST).read_text())
    result.timings = stages.timings
    return result


def _load(source, options: ExportOptions):
    model = load_model(source, task=options.task)
    folder = model.source.path
    pooling = load_pooling(folder)
    tokenizer = load_tokenizer(folder)
    cfg = model.config
    max_len = options.max_seq_len or (pooling.max_seq_length if pooling and pooling.max_seq_length else None) \
        or cfg.max_position_embeddings
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ExportError(f"--max-seq-len {max_len} is outside 1..{cfg.max_position_embeddings} "
                          f"(max_position_embeddings of {folder / 'config.json'})")
    return model, pooling, tokenizer, max_len


def _manifest(source, model, pooling, io, max_len, options: ExportOptions) -> dict:
    import onnx
    import onnxruntime

    from . import __version__

    cfg = model.config
    resolved = model.source
    return {
        "name": (Path(options.out).name if options.out else default_out(source).name),
        "source": {"id": resolved.hub_id, "revision": resolved.revision, "path": str(resolved.path),
                   "given": str(source)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tool_versions": {"mbert-export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
                          "onnxruntime": onnxruntime.__version__, "python": platform.python_version()},
        "task": cfg.task,
        "labels": {str(k): v for k, v in cfg.id2label.items()} or None,
        "model": {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "num_attention_heads": cfg.num_attention_heads, "local_attention": cfg.local_attention,
                  "vocab_size": cfg.vocab_size, "pad_token_id": cfg.pad_token_id,
                  "cls_token_id": cfg.cls_token_id, "sep_token_id": cfg.sep_token_id},
        "max_seq_len": max_len,
        "opset": options.opset,  # replaced by the opset read back from model.onnx in _write
        "io": {"inputs": [s.to_dict() for s in io if s.dtype == "int64"],
               "outputs": [s.to_dict() for s in io if s.dtype != "int64"]},
        "pooling": pooling.to_dict() if pooling and cfg.task == "encoder" else None,
        "artifacts": {"onnx_fp32": "model.onnx"},
    }


def _write(source, tmp: Path, manifest: dict, options: ExportOptions) -> None:
    from mbert.modeling import resolve

    from .onnx import graph_opset

    bundle_mod.copy_side_files(resolve(source).path, tmp)
    manifest["opset"] = graph_opset(tmp / "model.onnx")
    if options.fp16:
        manifest["artifacts"]["onnx_fp16"] = "model.fp16.onnx"
        manifest["artifacts"]["precision"] = "precision.json"
    if (tmp / "model.plan").is_file():
        manifest["artifacts"]["engine"] = "model.plan"
    from .triton import write_triton_repository

    engine = manifest.get("engine") or {}
    write_triton_repository(tmp, manifest, has_plan=(tmp / "model.plan").is_file(),
                            profiles=engine.get("profiles"), max_batch=options.max_batch)
    manifest["artifacts"]["triton"] = "triton/"
    bundle_mod.write_manifest(tmp, manifest)
