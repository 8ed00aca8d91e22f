#!/usr/bin/env python
"""INT8 on CPU: this project's planned ``model.int8.onnx`` against its FP32 ``model.onnx`` and the blind
quantizations, side by side in one run: throughput at 4 x 512 and on the mixed-length runtime corpus,
and the validation figures (worst pooled / per-token cosine vs eager FP32 on the grid, top-10
neighbour agreement) of ours and of blind.

Model: the seeded random full-size gte-modernbert-base checkpoint of ``runtime_cpu.py`` (22 layers,
hidden 768, CLS pooling), exported once with ``mbert-export --int8`` at ``max_seq_len`` 2048 (the INT8
stages of the pipeline: sensitivity, plan with its end-to-end checks, blind quantizations; their
cost is reported); ``--quick``: the tests' 2-layer ``helpers.TINY`` model at 128 tokens (the fixed batch 4 x 128), a smoke
test of every stage whose ratios mean nothing.

Systems (ONNX Runtime CPU, all threads, one session each, the same batches):

  fp32              model.onnx
  int8 (ours)       model.int8.onnx: the planned matrices, 7-bit per-channel weights
  blind 7-bit       every matrix INT8, our weight format (what the plan bought, weight format equal)
  blind st-vnni     every matrix INT8 with sentence-transformers' ``avx512_vnni`` settings (optimum:
                    per-channel, full-range int8 weights), written from our FP32 graph

sentence-transformers' own ``export_dynamic_quantized_onnx_model`` is not run: it needs optimum
(``optimum-onnx`` pins transformers < 4.58, this project's test extras have transformers 5 and
sentence-transformers 6), so it cannot be installed beside the project; "blind st-vnni" applies its
quantization settings to our FP32 graph instead.

Targets: INT8 >= 2x the FP32 graph's throughput at 4 x 512 and on the corpus; worst pooled
cosine >= 0.995; top-10 agreement >= 0.95.

    python benchmarks/int8_cpu.py            # full size -> results/int8_cpu.md (run once, on a quiet machine)
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

from mbert.bundle.names import TOKENIZER

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


def prepare(quick: bool, max_len: int, cache: Path = CACHE) -> tuple[Path, Path, dict]:
    """Checkpoint and bundle (cached): the --int8 export, or, when the INT8 plan fails, the FP32 bundle
    and the failure (reported)."""
    from helpers import TINY, make_checkpoint

    from mbert.export.options import ExportOptions
    from mbert.export.pipeline import export_bundle

    tag = "tiny" if quick else "base"
    ck, bundle = cache / f"checkpoint-{tag}", cache / f"bundle-{tag}-{max_len}-int8"
    status = bundle.parent / f"{bundle.name}.json"
    if not (ck / "special_tokens_map.json").is_file():  # written last by make_checkpoint
        log(f"building the random checkpoint ({tag})")
        make_checkpoint(ck, base="gte-modernbert-base", layout="cls-pooling", seed=0, **(TINY if quick else {}))
    if not status.is_file():
        log("exporting with --int8")
        t0, error = time.perf_counter(), None
        try:
            result = export_bundle(ck, ExportOptions(out=bundle, max_seq_len=max_len, overwrite=True, int8=True),
                                   report=lambda e, m: log(m))
            timings = result.timings
        except Exception as exc:  # noqa: BLE001 - a failing plan is a result: report it
            error = f"{type(exc).__name__}: {exc}"
            log(f"the --int8 export failed: {error}; exporting FP32 only")
            export_bundle(ck, ExportOptions(out=bundle, max_seq_len=max_len, overwrite=True))
            timings = {}
        status.write_text(json.dumps({"timings": timings, "total_s": time.perf_counter() - t0, "error": error}))
    return ck, bundle, json.loads(status.read_text())


def blind_graphs(bundle: Path) -> dict[str, Path]:
    from mbert.export.int8.graph import write_int8
    from mbert.export.int8.plan import S8, S8_7BIT

    out = {}
    for name, fmt in (("blind 7-bit", S8_7BIT), ("blind st-vnni", S8)):
        path = bundle.parent / f"{bundle.name}-{fmt.name}.onnx"
        if not path.is_file():
            write_int8(bundle / "model.onnx", path, None, fmt)
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
    ap.add_argument("--quick", action="store_true", help="tiny model, 128 tokens, short corpus (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=None, help="bundle max_seq_len (default 2048; --quick 128)")
    ap.add_argument("--out", type=Path, default=None, help="the report (default benchmarks/results/...)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="checkpoint and bundle folder")
    args = ap.parse_args()
    import runtime_cpu

    from mbert.bundle import open_bundle
    from mbert.bundle.texts import calibration_texts

    ck, bundle, status = prepare(args.quick, args.max_len or (128 if args.quick else 2048), args.cache)
    manifest = open_bundle(bundle).manifest
    max_len = manifest.max_seq_len
    spec = runtime_cpu.QUICK if args.quick else dict(runtime_cpu.FULL, max_len=max_len)
    corpus_texts = runtime_cpu.build_corpus(bundle / TOKENIZER, spec)
    pad = manifest.model.pad_token_id
    corpus = batches_for(bundle / TOKENIZER, corpus_texts, spec["max_len"], pad)
    long4 = sorted(calibration_texts(), key=len)[-4:]
    fixed = batches_for(bundle / TOKENIZER, long4, min(512, max_len), pad)[0]
    systems = {"fp32": bundle / "model.onnx"}
    if manifest.graph("int8") is not None:
        systems["int8 (ours)"] = bundle / "model.int8.onnx"
    systems.update(blind_graphs(bundle))
    results = {}
    for name, path in systems.items():
        log(f"timing {name}")
        results[name] = timed(path, fixed, corpus, args.repeats)
    text = report(args, manifest, status, results, corpus, fixed, spec)
    out = args.out or REPO / "benchmarks" / "results" / ("int8_cpu_quick.md" if args.quick else "int8_cpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    from mbert.bundle.schema import to_json

    out.with_suffix(".json").write_text(json.dumps({"results": results, "int8": to_json(manifest.int8),
                                                    "status": status, "cpu": cpu_flags()}, indent=2))
    print(text)
    log(f"wrote {out}")


def _figures(name: str, validation, retrieval, gating: bool) -> str:
    o = {x.name: x for x in validation.outputs}
    pooled = o["sentence_embedding"].worst_cosine if "sentence_embedding" in o else None
    token = o["last_hidden_state"].worst_cosine
    r = retrieval
    passed = validation.passed and (r is None or r.passed)
    cells = [f"{pooled:.5f}" if pooled is not None else "-", f"{token:.5f}" if token is not None else "not finite",
             f"{r.mean_agreement:.3f} / {r.worst_agreement:.1f}" if r else "-", f"{r.mixed_mean_agreement:.3f}" if r else "-",
             ("pass" if passed else "FAIL") + ("" if gating else " (reported only)")]
    return f"| {name} | " + " | ".join(cells) + " |"


def report(args, manifest, status, results, corpus, fixed, spec) -> str:
    from mbert import export
    from mbert.bundle.int8 import plan_table, summary_lines
    from mbert.runtime.cli.info import table

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
             f"| system | {fixed[0].shape[0]}x{fixed[0].shape[1]} ms | x FP32 | corpus s | tokens/s | x FP32 |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['fixed_s'] * 1e3:.0f} | {base['fixed_s'] / r['fixed_s']:.2f}x | {r['corpus_s']:.1f} "
                     f"| {tokens / r['corpus_s']:.0f} | {base['corpus_s'] / r['corpus_s']:.2f}x |")
    lines += ["", "sentence-transformers' own INT8 export (`export_dynamic_quantized_onnx_model`) is not in the table: "
              "optimum pins transformers < 4.58 and cannot be installed beside this project; \"blind st-vnni\" is "
              "its quantization settings applied to our FP32 graph."]
    r8 = manifest.int8
    if r8 is None:
        lines += ["", "## The INT8 plan FAILED: no model.int8.onnx", "", f"`{status.get('error')}`"]
        return "\n".join(lines) + "\n"
    lines += ["", "## Validation against the eager FP32 model (worst over the grid)", "",
              "| graph | worst pooled cosine | worst token cosine | top-10 agreement (mean / worst query) "
              "| INT8 queries vs FP32 index | verdict |", "|---|---|---|---|---|---|",
              _figures("int8 (ours)", manifest.graph("int8").validation, r8.retrieval, True)]
    for b in r8.blind:
        lines.append(_figures(b.name, b.validation, b.retrieval, False) if b.validation is not None
                     else f"| {b.name} | could not run: {b.error} | | | | |")
    if r8.retrieval is not None:
        lines += ["", f"FP32 neighbour lists: median cosine gap between neighbours 10 and 11 "
                      f"{r8.retrieval.fp32_gap_median:.4f}, between neighbours 1 and 10 "
                      f"{r8.retrieval.fp32_score_spread_median:.4f} (random weights: near-ties)."]
    headers, rows = plan_table(r8)
    timings = status.get("timings", {})
    lines += ["", "## The plan", "", "Export stages: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
              + f" (total {status.get('total_s', 0):.0f}s).", "", "```", *summary_lines(r8), "", table(rows, headers),
              "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
