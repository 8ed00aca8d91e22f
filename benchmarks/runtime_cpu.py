#!/usr/bin/env python
"""Encoding throughput on CPU: mbert.runtime (ONNX Runtime) vs sentence-transformers (PyTorch) vs
sentence-transformers with backend="onnx" (optimum), on the same random full-size weights.

One seeded random gte-modernbert-base-shaped checkpoint (22 layers, hidden 768, CLS pooling; built
with tests/helpers.make_checkpoint) and one mixed-length corpus cut from the built-in calibration
texts (short queries up to multi-thousand-token documents), the same max_seq_length everywhere.
Each system runs once, in its own subprocess, after a short warm-up:

  mbert-runtime  Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(corpus)
  st-torch       SentenceTransformer(checkpoint, device="cpu").encode(corpus)
  st-onnx        SentenceTransformer(checkpoint, device="cpu", backend="onnx").encode(corpus)

st-onnx needs optimum's ONNX exporter (``optimum-onnx[onnxruntime]``), which pins transformers < 4.58
while sentence-transformers 6 needs transformers >= 5: they cannot share one environment. The
script uses the current Python when it has ``optimum.onnxruntime``, else ``--onnx-python`` /
$MBERT_ST_ONNX_PYTHON (e.g. a venv made with
``python -m venv --system-site-packages V && V/bin/pip install 'optimum-onnx[onnxruntime]' 'sentence-transformers>=5,<6'``),
else it reports why the column is missing.

Then the runtime's own overhead on 4 x 512-token batches: tokenization, batching and pooling
against the raw backend call on the same ids (target: < 5 % of the call).

    python benchmarks/runtime_cpu.py            # 200 texts, ~27k tokens, up to 2048 -> results/runtime_cpu.md
    python benchmarks/runtime_cpu.py --quick    # the tests' 2-layer TINY model, 20 texts, 128 tokens
                                                # (smoke test, seconds) -> results/runtime_cpu_quick.md
    --out FILE: the report elsewhere; --cache DIR: the models' folder (tests use both)

Checkpoint, bundle and the st-onnx export are cached in benchmarks/.cache/runtime_cpu/ (git-ignored;
the quick model in its tiny/ folder); the first run also builds them (the full-size export traces
and validates 22 layers: ~5 minutes on 2 cores, once per max length).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mbert.bundle.names import MANIFEST, TOKENIZER

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "benchmarks" / ".cache" / "runtime_cpu"
SYSTEMS = ("mbert-runtime", "st-torch", "st-onnx")
# (name, count, min tokens, max tokens) per corpus bucket
# ~27k tokens: the three systems take ~5-8 minutes on 2 quiet cores (--quick measured ~600 / 190 / 230
# tokens/s on texts up to 512 tokens; longer documents cost more per token)
FULL = dict(max_len=2048, buckets=[("query", 115, 6, 30), ("passage", 60, 40, 200), ("document", 20, 256, 768),
                                   ("long document", 5, 1024, 2048)])
# --quick: a few texts of each kind, the documents longer than max_len (so truncation runs too)
QUICK = dict(max_len=128, buckets=[("query", 8, 6, 30), ("passage", 8, 40, 120), ("document", 4, 100, 200)])
BATCH_SIZE = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- preparation -----------------------------------------------------------------------------------

def prepare(max_len: int, tiny: bool = False) -> tuple[Path, Path]:
    """The cached checkpoint (full size, or with ``tiny`` the tests' 2-layer ``helpers.TINY``) and a bundle
    exported from it with ``max_seq_len=max_len``."""
    ck = CACHE / ("checkpoint-tiny" if tiny else "checkpoint")
    if not (ck / "special_tokens_map.json").is_file():  # written last by make_checkpoint
        log(f"building the random {'tiny' if tiny else 'full-size'} checkpoint (gte-modernbert-base shape, "
            "CLS pooling)")
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import TINY, make_checkpoint

        make_checkpoint(ck, base="gte-modernbert-base", layout="cls-pooling", seed=0, **(TINY if tiny else {}))
    bundle = CACHE / f"bundle-{max_len}"
    if not (bundle / MANIFEST).is_file():
        from mbert.export.options import ExportOptions
        from mbert.export.pipeline import export_bundle

        log(f"exporting the bundle (max_seq_len {max_len}; trace + validation take a few minutes)")
        t0 = time.perf_counter()
        export_bundle(ck, ExportOptions(out=bundle, max_seq_len=max_len, overwrite=True))
        log(f"exported in {time.perf_counter() - t0:.0f}s")
    return ck, bundle


def build_corpus(tokenizer_json: Path, spec: dict, seed: int = 0) -> list[str]:
    """Slices of the calibration texts cut at token boundaries to each bucket's lengths, shuffled."""
    from tokenizers import Tokenizer

    from mbert.bundle.texts import calibration_texts

    tok = Tokenizer.from_file(str(tokenizer_json))
    docs = [(t, tok.encode(t, add_special_tokens=False).offsets) for t in calibration_texts()]
    rng = random.Random(seed)
    corpus = []
    for _, count, lo, hi in spec["buckets"]:
        for _ in range(count):
            n = rng.randint(lo, hi) - 2  # [CLS] and [SEP] are added by the tokenizer
            fitting = [d for d in docs if len(d[1]) >= n] or [max(docs, key=lambda d: len(d[1]))]
            text, offsets = rng.choice(fitting)
            start = rng.randint(0, max(0, len(offsets) - n))
            end = min(len(offsets), start + n) - 1
            corpus.append(text[offsets[start][0]: offsets[end][1]].strip() or text[:50])
    rng.shuffle(corpus)
    return corpus


# --- one system, in its own process ---------------------------------------------------------------

def child(system: str, ck: Path, bundle: Path, corpus_file: Path, max_len: int, out: Path) -> None:
    import numpy as np

    corpus = json.loads(corpus_file.read_text())
    warm = corpus[:8]
    info: dict = {}
    t_load = time.perf_counter()
    if system == "mbert-runtime":
        from mbert.runtime import Encoder

        enc = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
        info["backend"] = f"{enc.backend_name} ({enc.backend.artifact}, {enc.precision})"

        def encode(texts):
            return enc.encode(texts, batch_size=BATCH_SIZE)
    else:
        from sentence_transformers import SentenceTransformer

        kwargs = {}
        if system == "st-onnx":
            saved = CACHE / "st-onnx-model"
            if (saved / "onnx" / "model.onnx").is_file():
                ck = saved
            kwargs["backend"] = "onnx"
        model = SentenceTransformer(str(ck), device="cpu", **kwargs)
        if system == "st-onnx" and ck != CACHE / "st-onnx-model":
            model.save_pretrained(str(CACHE / "st-onnx-model"))
            info["exported_onnx_s"] = time.perf_counter() - t_load
        model.max_seq_length = max_len
        import torch

        info["torch_threads"] = torch.get_num_threads()

        def encode(texts):
            return model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)
    info["load_s"] = time.perf_counter() - t_load
    encode(warm)
    t0 = time.perf_counter()
    vectors = np.asarray(encode(corpus), dtype=np.float32)
    info["seconds"] = time.perf_counter() - t0
    if system == "mbert-runtime":
        s = enc.last_stats
        info["stats"] = {k: getattr(s, k) for k in ("texts", "tokens", "padded_tokens", "truncated", "batches",
                                                       "tokenize_s", "batching_s", "backend_s", "pooling_s", "total_s")}
        info["overhead"] = overhead_split(enc, max_len)
    np.save(out.with_suffix(".npy"), vectors)
    out.write_text(json.dumps(info))


def overhead_split(enc, max_len: int, repeats: int = 5) -> dict:
    """encode() of 4 texts of >= 512 tokens (cut to 512) vs the raw backend call on the same ids."""
    import warnings

    from mbert.bundle.texts import calibration_texts
    from mbert.bundle.tokenizer import pad_batch
    from mbert.runtime.text import TextEncoder

    length = min(512, max_len)
    cut = copy.copy(enc)  # the same bundle and session, truncating at `length`
    cut.max_length, cut.text = length, TextEncoder(enc.bundle.path_of(TOKENIZER), length)
    long_texts = sorted(calibration_texts(), key=len)[-4:]  # each > 2000 tokens: cut to exactly 512
    encodings = cut.text.encode(long_texts)
    ids, mask = pad_batch([e.ids for e in encodings], cut.backend.pad_to(max(len(e.ids) for e in encodings), 4),
                          cut.pad_id)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cut.encode(long_texts, batch_size=4)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            cut.backend.run(ids, mask, ["sentence_embedding"])
            raw = time.perf_counter() - t0
            cut.encode(long_texts, batch_size=4)
            s = cut.last_stats
            rows.append(dict(raw=raw, total=s.total_s, backend=s.backend_s, tokenize=s.tokenize_s,
                             batching=s.batching_s, pooling=s.pooling_s))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["shape"] = list(ids.shape)
    med["overhead_vs_raw"] = (med["total"] - med["raw"]) / med["raw"]
    med["overhead_in_call"] = (med["total"] - med["backend"]) / med["total"]
    return med


def onnx_python(arg: str | None) -> tuple[str | None, str]:
    """A Python that can run sentence-transformers' ONNX backend, or None and the reason."""
    candidates = [sys.executable] + [p for p in (arg, os.environ.get("MBERT_ST_ONNX_PYTHON")) if p]
    why = []
    for py in dict.fromkeys(candidates):
        code = "import optimum.onnxruntime, sentence_transformers; print(sentence_transformers.__version__)"
        done = subprocess.run([py, "-c", code], capture_output=True, text=True)
        if done.returncode == 0:
            return py, f"sentence-transformers {done.stdout.strip()} in {py}"
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        why.append(f"{py}: {last}")
    return None, ("sentence-transformers' ONNX backend needs optimum-onnx[onnxruntime], which pins "
                  "transformers<4.58 while sentence-transformers 6 needs transformers>=5, so it cannot be "
                  "installed next to this project's test dependencies; pass --onnx-python with a venv that has "
                  "it (see the module docstring). Tried: " + "; ".join(why))


def run_system(system: str, py: str, ck: Path, bundle: Path, corpus_file: Path, max_len: int) -> dict:
    out = CACHE / f"result-{system}.json"
    out.unlink(missing_ok=True)
    cmd = [py, str(Path(__file__).resolve()), "--child", system, "--cache", str(CACHE), "--ck", str(ck),
           "--bundle", str(bundle),
           "--corpus", str(corpus_file), "--max-len", str(max_len), "--result", str(out)]
    log(f"running {system}")
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="true"))
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(out.read_text())


# --- report -----------------------------------------------------------------------------------------

def report(args, spec, corpus, lengths, results, onnx_note) -> str:
    import numpy as np

    from mbert import export

    total_tokens = sum(lengths)
    truncated = sum(1 for n in lengths if n > spec["max_len"])
    capped = sum(min(n, spec["max_len"]) for n in lengths)
    lines = [f"# Runtime encoding throughput on CPU{' (--quick)' if args.quick else ''}", "",
             f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}, mbert-export {export.__version__}.",
             "Model: " + ("random gte-modernbert-base-shaped, the tests' 2-layer TINY (smoke test, not the target size)."
                          if args.quick else
                          "random full-size gte-modernbert-base weights (22 layers, hidden 768, CLS pooling, no "
                          "Normalize)."),
             f"Corpus: {len(corpus)} texts cut from the built-in calibration set, {total_tokens} tokens before "
             f"truncation ({capped} after; {truncated} texts longer than max_seq_length {spec['max_len']}), "
             f"lengths {min(lengths)}..{max(lengths)} (median {int(statistics.median(lengths))}).",
             "Buckets: " + ", ".join(f"{c} {n} ({lo}-{hi} tokens)" for n, c, lo, hi in spec["buckets"]) + ".",
             f"Same max_seq_length ({spec['max_len']}) and batch_size ({BATCH_SIZE}) for all; one timed run each after "
             "a warm-up on 8 texts; each system in its own process, all CPU threads.", "",
             "| system | seconds | texts/s | tokens/s | vs st-torch | min cosine vs mbert-runtime |",
             "|---|---|---|---|---|---|"]
    base = results.get("st-torch", {}).get("seconds")
    ours_vec = CACHE / "result-mbert-runtime.npy"
    ref = np.load(ours_vec) if ours_vec.is_file() and "error" not in results.get("mbert-runtime", {}) else None
    for system in SYSTEMS:
        r = results.get(system, {})
        if "seconds" not in r:
            lines.append(f"| {system} | - | - | - | - | not run: {r.get('error') or onnx_note} |")
            continue
        vec = np.load(CACHE / f"result-{system}.npy")
        cos = "-"
        if ref is not None:
            c = (vec * ref).sum(1) / (np.linalg.norm(vec, axis=1) * np.linalg.norm(ref, axis=1))
            cos = f"{c.min():.6f}"
        ratio = f"{base / r['seconds']:.2f}x" if base else "-"
        lines.append(f"| {system} | {r['seconds']:.1f} | {len(corpus) / r['seconds']:.1f} | {capped / r['seconds']:.0f} "
                     f"| {ratio} | {cos} |")
    ours = results.get("mbert-runtime", {})
    if "stats" in ours:
        s = ours["stats"]
        lines += ["", f"mbert-runtime: {s['batches']} batches, {s['padded_tokens']} padded tokens for {s['tokens']} real "
                  f"({s['padded_tokens'] / s['tokens'] - 1:.1%} padding), {s['truncated']} truncated; time split: "
                  f"tokenize {s['tokenize_s']:.2f}s, batching {s['batching_s']:.3f}s, backend {s['backend_s']:.1f}s, "
                  f"pooling {s['pooling_s']:.3f}s of {s['total_s']:.1f}s."]
    if "exported_onnx_s" in results.get("st-onnx", {}):
        lines.append(f"st-onnx exported its ONNX model in {results['st-onnx']['exported_onnx_s']:.0f}s (not timed above).")
    if onnx_note:
        lines.append(f"st-onnx environment: {onnx_note}")
    o = ours.get("overhead")
    if o:
        verdict = "meets" if o["overhead_vs_raw"] < 0.05 else "MISSES"
        lines += ["", f"## Runtime overhead on a {o['shape'][0]} x {o['shape'][1]} batch (median of 5)", "",
                  "| part | ms |", "|---|---|",
                  f"| raw backend call (pre-built ids) | {o['raw'] * 1e3:.1f} |",
                  f"| encode() total | {o['total'] * 1e3:.1f} |",
                  f"| - backend call inside encode() | {o['backend'] * 1e3:.1f} |",
                  f"| - tokenization | {o['tokenize'] * 1e3:.2f} |",
                  f"| - batching (sort, pad arrays) | {o['batching'] * 1e3:.2f} |",
                  f"| - pooling / normalization | {o['pooling'] * 1e3:.2f} |",
                  "", f"Overhead: encode() vs raw call {o['overhead_vs_raw']:+.2%}; time outside the backend "
                  f"inside encode() {o['overhead_in_call']:.2%} ({verdict} the < 5% target)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    global CACHE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tests' 2-layer TINY model, 20 texts, 128 tokens (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="markdown report (default benchmarks/results/...)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="the models' folder (--quick: its tiny/ folder)")
    ap.add_argument("--onnx-python", default=None, help="Python with sentence-transformers + optimum-onnx")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--bundle", type=Path, help="measure this bundle (with --ck, its checkpoint, for the "
                    "sentence-transformers systems) instead of the cached one (the smoke test passes a shared one)")
    ap.add_argument("--ck", type=Path, help="the checkpoint --bundle was exported from")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    for hidden in ("--corpus", "--result"):
        ap.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    CACHE = args.cache if args.child else args.cache / "tiny" if args.quick else args.cache
    if args.child:
        child(args.child, args.ck, args.bundle, args.corpus, args.max_len, args.result)
        return
    if (args.bundle is None) != (args.ck is None):
        ap.error("--bundle and --ck go together")
    spec = QUICK if args.quick else FULL
    CACHE.mkdir(parents=True, exist_ok=True)
    ck, bundle = (args.ck, args.bundle) if args.bundle else prepare(spec["max_len"], tiny=args.quick)
    corpus = build_corpus(bundle / TOKENIZER, spec)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundle / TOKENIZER))
    lengths = [len(e.ids) for e in tok.encode_batch(corpus)]
    log(f"corpus: {len(corpus)} texts, {sum(lengths)} tokens (max {max(lengths)})")
    corpus_file = CACHE / "corpus.json"
    corpus_file.write_text(json.dumps(corpus))
    results, onnx_note = {}, ""
    for system in [s for s in SYSTEMS if s in args.systems.split(",")]:
        py = sys.executable
        if system == "st-onnx":
            py, onnx_note = onnx_python(args.onnx_python)
            if py is None:
                results[system] = {"error": onnx_note}
                log(f"st-onnx skipped: {onnx_note}")
                continue
        results[system] = run_system(system, py, ck, bundle, corpus_file, spec["max_len"])
        log(f"{system}: {results[system].get('seconds', results[system].get('error'))}")
    text = report(args, spec, corpus, lengths, results, onnx_note)
    out = args.out or REPO / "benchmarks" / "results" / ("runtime_cpu_quick.md" if args.quick else "runtime_cpu.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
