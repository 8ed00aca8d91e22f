#!/usr/bin/env python
"""INT8 on CPU: this project's planned ``model.int8.onnx`` against its FP32 ``model.onnx`` and the blind
quantizations, side by side in one run: throughput at 4 x 512 and on the mixed-length runtime corpus,
and the validation figures (worst pooled / per-token cosine vs eager FP32 on the grid, top-10 neighbour
agreement) of ours and of blind.

Model: the seeded random full-size gte-modernbert-base checkpoint of ``runtime_cpu.py`` (22 layers,
hidden 768, CLS pooling), exported with ``max_seq_len`` 2048 (``--quick``: a 4-layer hidden-256 model,
512 tokens, for smoke tests; its ratios mean nothing). The INT8 stage (``mbert.export.int8_check.run_int8``:
sensitivity plan, graph, validation) runs once and its plan table is printed; the report states its cost.

Systems (ONNX Runtime CPU, all threads, one session each, the same batches):

  fp32              model.onnx
  int8 (ours)       model.int8.onnx: the planned matrices, 7-bit per-channel weights
  blind 7-bit       every matrix INT8, our weight format (what the plan bought, weight format equal)
  blind st-vnni     every matrix INT8 with sentence-transformers' ``avx512_vnni`` settings (optimum:
                    per-channel, full-range int8 weights), quantized from our FP32 graph
  st-int8           sentence-transformers' own ``export_dynamic_quantized_onnx_model(model, "avx512_vnni")``
                    model, when a Python with sentence-transformers + optimum is given (``--onnx-python``;
                    optimum pins transformers < 4.58 and cannot be installed beside this project: see
                    runtime_cpu.py)

Targets (issue 12): INT8 >= 2x the FP32 graph's throughput at 4 x 512 and on the corpus; worst pooled
cosine >= 0.995; top-10 agreement >= 0.95.

    python benchmarks/int8_cpu.py            # full size -> results/int8_cpu.md (~1 h on 2 cores, once)
    python benchmarks/int8_cpu.py --quick    # small model smoke test -> results/int8_cpu_quick.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "benchmarks" / ".cache" / "int8_cpu"
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
BATCH = 32
INT8_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return {f: f in flags for f in INT8_FLAGS}


def saturation_probe() -> dict[str, bool]:
    """Is ONNX Runtime's U8S8 product exact on this CPU at the worst case, per weight range?"""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out = {}
    for name, qmax in (("s8-7bit (+-64)", 64), ("s8 full range (+-127)", 127)):
        b = np.full((64, 8), qmax, dtype=np.int8)
        a = np.full((4, 64), 255, dtype=np.uint8)
        g = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [4, 8])],
                              [numpy_helper.from_array(b, "b")])
        s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                 providers=["CPUExecutionProvider"])
        out[name] = bool(np.array_equal(s.run(None, {"a": a})[0], a.astype(np.int64) @ b.astype(np.int64)))
    return out


def prepare(quick: bool, max_len: int) -> tuple[Path, Path, dict]:
    """Checkpoint, FP32 bundle, and the INT8 stage's outputs inside it (cached)."""
    from helpers import make_checkpoint

    from mbert.export.pipeline import ExportOptions, export_bundle

    tag = "quick" if quick else "base"
    ck, bundle = CACHE / f"checkpoint-{tag}", CACHE / f"bundle-{tag}-{max_len}"
    small = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=384) if quick else {}
    if not (ck / "model.safetensors").is_file():
        log(f"building the random checkpoint ({tag})")
        make_checkpoint(ck, base="gte-modernbert-base", layout="cls-pooling", seed=0, **small)
    if not (bundle / "manifest.json").is_file():
        log("exporting the FP32 bundle")
        export_bundle(ck, ExportOptions(out=bundle, max_seq_len=max_len, overwrite=True))
    if not (bundle / "int8.json").is_file():
        run_stage(ck, bundle)
    return ck, bundle, json.loads((bundle / "int8.json").read_text())


def run_stage(ck: Path, bundle: Path) -> None:
    from mbert.export.int8_check import print_plan, run_int8
    from mbert.export.onnx import GraphModule
    from mbert.export.pipeline import _Stages
    from mbert.export.texts import calibration_texts
    from mbert.export.validate import build_cases, default_grid, eager_runner, load_tokenizer
    from mbert.modeling import ValidationError, load_model, load_pooling

    max_len = json.loads((bundle / "manifest.json").read_text())["max_seq_len"]
    model = load_model(ck)
    graph = GraphModule(model, load_pooling(ck)).eval()
    tok, cfg, texts = load_tokenizer(ck), model.config, calibration_texts()
    cases = build_cases(tok, texts, default_grid(cfg.window_half_width, max_len), cfg.cls_token_id,
                        cfg.sep_token_id, cfg.pad_token_id)
    stages = _Stages(lambda e, m: log(m), 3)
    t0 = time.perf_counter()
    try:
        outcome = run_int8(graph, tok, texts, cases, eager_runner(graph), bundle, max_len, texts, stages)
        log("INT8 plan:\n" + print_plan(outcome.plan))
    except ValidationError as exc:
        log(f"ours FAILED validation: {exc}")
    doc = json.loads((bundle / "int8.json").read_text())
    doc["stage_timings"] = dict(stages.timings, total=time.perf_counter() - t0)
    (bundle / "int8.json").write_text(json.dumps(doc, indent=2) + "\n")


def blind_graphs(bundle: Path) -> dict[str, Path]:
    from mbert.export.int8 import S8, S8_7BIT
    from mbert.export.int8_graph import quantize_graph

    out = {}
    for name, fmt in (("blind 7-bit", S8_7BIT), ("blind st-vnni", S8)):
        path = bundle.parent / f"{bundle.name}-{fmt.name}.onnx"
        if not path.is_file():
            quantize_graph(bundle / "model.onnx", path, None, fmt)
        out[name] = path
    return out


def batches_for(tokenizer_json: Path, texts: list[str], max_len: int, pad_id: int):
    """The runtime's batching: sort by length, 32 per batch, pad to a multiple of 8."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_padding()
    tok.enable_truncation(max_len)
    enc = sorted((e.ids for e in tok.encode_batch(texts)), key=len)
    out = []
    for i in range(0, len(enc), BATCH):
        rows = enc[i:i + BATCH]
        T = min(max_len, -(-max(len(r) for r in rows) // 8) * 8)
        ids = np.full((len(rows), T), pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, :len(r)], mask[j, :len(r)] = r, 1
        out.append((ids, mask))
    return out


def timed(path: Path, fixed, corpus, repeats: int) -> dict:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = lambda ids, mask: {"input_ids": ids, "attention_mask": mask}  # noqa: E731
    session.run(["sentence_embedding"], feed(*fixed))  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(["sentence_embedding"], feed(*fixed))
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for ids, mask in corpus:
        session.run(["sentence_embedding"], feed(ids, mask))
    return {"fixed_s": statistics.median(ts), "corpus_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, 512 tokens, short corpus (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=None, help="bundle max_seq_len (default 2048; --quick 512)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import runtime_cpu

    ck, bundle, doc = prepare(args.quick, args.max_len or (512 if args.quick else 2048))
    manifest = json.loads((bundle / "manifest.json").read_text())
    max_len = manifest["max_seq_len"]
    spec = runtime_cpu.QUICK if args.quick or max_len <= 512 else dict(runtime_cpu.FULL, max_len=max_len)
    corpus_texts = runtime_cpu.build_corpus(bundle / "tokenizer.json", spec)
    pad = manifest["model"]["pad_token_id"]
    corpus = batches_for(bundle / "tokenizer.json", corpus_texts, spec["max_len"], pad)
    from mbert.export.texts import calibration_texts

    long4 = sorted(calibration_texts(), key=len)[-4:]
    fixed = batches_for(bundle / "tokenizer.json", long4, 512, pad)[0]
    systems = {"fp32": bundle / "model.onnx", "int8 (ours)": bundle / "model.int8.onnx", **blind_graphs(bundle)}
    results = {}
    for name, path in systems.items():
        log(f"timing {name}")
        results[name] = timed(path, fixed, corpus, args.repeats)
    text = report(args, doc, results, corpus, fixed, spec)
    out = args.out or REPO / "benchmarks" / "results" / ("int8_cpu_quick.md" if args.quick else "int8_cpu.md")
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"results": results, "int8": doc, "cpu": cpu_flags()}, indent=2))
    print(text)
    log(f"wrote {out}")


def report(args, doc, results, corpus, fixed, spec) -> str:
    from mbert import export
    from mbert.export.int8 import Int8Plan
    from mbert.export.int8_check import print_plan

    tokens = int(sum(m.sum() for _, m in corpus))
    base = results["fp32"]
    flags = cpu_flags()
    lines = [f"# INT8 on CPU{' (--quick: small model, ratios mean nothing)' if args.quick else ''}", "",
             f"Run {datetime.datetime.now():%Y-%m-%d %H:%M} on {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, mbert-export {export.__version__}. CPU int8 flags: "
             + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items()) + ".",
             "ONNX Runtime U8S8 product exact at the worst case on this CPU: "
             + ", ".join(f"{k}: {'yes' if v else 'NO (vpmaddubsw saturates)'}" for k, v in saturation_probe().items()),
             "", f"Shapes: fixed batch {fixed[0].shape[0]} x {fixed[0].shape[1]} (median of {args.repeats}); corpus "
             f"{len(corpus)} batches of <= {BATCH}, {tokens} real tokens, max {spec['max_len']}.", "",
             "| system | 4x512 ms | x FP32 | corpus s | tokens/s | x FP32 |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['fixed_s'] * 1e3:.0f} | {base['fixed_s'] / r['fixed_s']:.2f}x | {r['corpus_s']:.1f} "
                     f"| {tokens / r['corpus_s']:.0f} | {base['corpus_s'] / r['corpus_s']:.2f}x |")
    v = doc["validation"]
    lines += ["", "## Validation against the eager FP32 model (worst over the grid)", "",
              "| graph | worst pooled cosine | worst token cosine | top-10 agreement (mean / worst query) "
              "| INT8 queries vs FP32 index | verdict |", "|---|---|---|---|---|---|"]
    for name, rep in [("int8 (ours)", v), *v.get("blind", {}).items()]:
        if "error" in rep:
            lines.append(f"| {name} | error: {rep['error']} | | | | |")
            continue
        o = {x["name"]: x for x in rep["outputs"]}
        r = rep.get("retrieval") or {}
        lines.append(f"| {name} | {o.get('sentence_embedding', {}).get('worst_cosine', float('nan')):.5f} "
                     f"| {o['last_hidden_state']['worst_cosine']:.5f} | {r.get('mean_agreement', float('nan')):.3f} / "
                     f"{r.get('worst_agreement', float('nan')):.1f} | {r.get('mixed_mean_agreement', float('nan')):.3f} "
                     f"| {'pass' if rep['passed'] else 'FAIL'}{'' if name == 'int8 (ours)' else ' (reported only)'} |")
    p = Int8Plan.from_dict(doc["plan"])
    t = doc.get("stage_timings", {})
    lines += ["", "## The plan", "", f"Cost: {', '.join(f'{k} {v:.0f}s' for k, v in t.items())} "
              f"(solo passes {p.cost_s.get('solo', 0):.0f}s, combined checks {p.cost_s.get('combined', 0):.0f}s); "
              f"calibration {p.calibration}. Kernels run (ONNX Runtime profiler): {doc['graph']['kernels']}.",
              "", "```", print_plan(p), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
