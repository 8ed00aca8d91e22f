#!/usr/bin/env python
"""The C++ client (clients/cpp, mbert::TritonEmbedder) against the Python TritonEncoder on the same
served bundle, with in-process ``Encoder.encode`` as the ceiling, on the same texts.

  C++ client   mbert-embed-threads --threads C --queue: C threads, each with its own TritonEmbedder
               (HTTP, binary output), each taking the next text of the corpus until it is done
  Python       C threads, each with its own TritonEncoder over HTTP (tritonclient), the same way
  in-process   Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(corpus): one
               call on the whole corpus (the runtime sorts it by length and batches it)

One text per request; the server (``mbert-run serve``: ensemble -> tokenizer -> ONNX Runtime in the
Python backend) batches across requests. Latency is per request, measured in the client. The served
vectors are checked against the in-process ones (min cosine).

    python benchmarks/cpp_client.py            # full-size random gte-modernbert-base, 120 texts up to
                                               # 512 tokens -> results/cpp_client.{md,json}
    python benchmarks/cpp_client.py --quick    # the tests' 2-layer TINY model, 48 short texts (smoke test)
                                               # -> results/cpp_client_quick.{md,json}
    ... --url http://127.0.0.1:PORT --model NAME --bundle B --cpp-build DIR   # an already served
                                               # bundle and an already built client (the test's)

The full-size checkpoint and bundle are runtime_cpu.py's (benchmarks/.cache/runtime_cpu/); the quick
bundle is triton_serve.py's; the client is built into benchmarks/.cache/cpp_client/build.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from runtime_cpu import build_corpus, log, prepare  # noqa: E402
from triton_serve import FULL, drain  # noqa: E402

CACHE = REPO / "benchmarks" / ".cache" / "cpp_client"
QUICK = dict(max_len=512, buckets=[("query", 24, 6, 30), ("passage", 16, 60, 200), ("document", 8, 200, 400)])
SYSTEMS = ("C++ mbert::TritonEmbedder", "Python TritonEncoder", "in-process Encoder.encode")
WARM = 8  # requests per client kind before timing (first requests load kernels and connections)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def in_process(bundle: Path, corpus: list[str]) -> tuple[dict, np.ndarray]:
    from mbert.runtime import Encoder

    enc = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc.encode(corpus[:WARM])
        t0 = time.perf_counter()
        vectors = enc.encode(corpus)
        seconds = time.perf_counter() - t0
    return {"system": SYSTEMS[2], "texts": len(corpus), "failed": 0, "seconds": seconds, "latencies_ms": [],
            "tokens": enc.last_stats.tokens, "max_length": enc.max_length}, vectors


def cpp_client(build: Path, url: str, model: str, corpus: list[str], clients: int) -> tuple[dict, list]:
    program = str(build / "mbert-embed-threads")
    subprocess.run([program, "--url", url, "--model", model, "--threads", "2", "--requests", str(WARM // 2),
                    *corpus[:WARM]], capture_output=True, check=True, timeout=600)
    done = subprocess.run([program, "--url", url, "--model", model, "--threads", str(clients), "--queue", *corpus],
                          capture_output=True, text=True, timeout=3600)
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    vectors: list = [None] * len(corpus)
    errors = []
    for a in answers:
        if "error" in a:
            errors.append(a["error"])
        else:
            vectors[a["text"]] = np.array(a["embedding"], dtype=np.float32)
    return {"system": SYSTEMS[0], "texts": len(answers), "failed": len(errors), "seconds": summary["wall_s"],
            "latencies_ms": [a["ms"] for a in answers if "error" not in a], "errors": errors[:3]}, vectors


def python_client(url: str, model: str, corpus: list[str], clients: int) -> tuple[dict, list]:
    from mbert.runtime import TritonEncoder

    address = url.removeprefix("http://")
    warm = TritonEncoder(address, model=model)
    for text in corpus[:WARM]:
        warm.encode([text])
    vectors, latencies, errors, seconds = drain(lambda c: TritonEncoder(address, model=model, timeout=600),
                                                corpus, clients)
    return {"system": SYSTEMS[1], "texts": len(latencies) + len(errors), "failed": len(errors), "seconds": seconds,
            "latencies_ms": [s * 1000 for s in latencies], "errors": errors[:3]}, vectors


def finish(row: dict, vectors: list | None, want: np.ndarray) -> dict:
    lat = np.array(row.pop("latencies_ms"), dtype=np.float64)
    row["texts_per_s"] = row["texts"] / row["seconds"]
    row["p50_ms"] = float(np.percentile(lat, 50)) if lat.size else None
    row["p99_ms"] = float(np.percentile(lat, 99)) if lat.size else None
    if vectors is None:
        row["min_cosine"] = None
    else:
        ok = [i for i, v in enumerate(vectors) if v is not None]
        row["min_cosine"] = float(cosines(np.stack([vectors[i] for i in ok]), want[ok]).min()) if ok else 0.0
    return row


def report(args, corpus: list[str], rows: list[dict]) -> str:
    from mbert import export

    ceiling = rows[-1]["texts_per_s"]
    ms = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"# C++ client vs Python client vs in-process on CPU{' (--quick)' if args.quick else ''}", "",
             f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}, mbert-export {export.__version__}, "
             "tritonserver 2.51.0 (nvidia-pytriton 0.7.0, `mbert-run serve`), Python backend only. Load average "
             f"at the start: {args.load:.1f}. The server, the clients and any other job on the "
             "machine share its cores (numbers mean little unless the load is near 0); the ratios within one "
             "run are what the table is for.",
             f"Model: {args.model_label}.",
             f"Corpus: {len(corpus)} texts cut from the built-in calibration set, {rows[-1]['tokens']} tokens after "
             f"truncation to the bundle's {rows[-1]['max_length']}, the corpus once per system.",
             f"Served: {args.clients} concurrent clients on loopback, HTTP, one text per request, each client "
             "taking the next text until none is left; latency per request, measured in the client. "
             "In-process: one Encoder.encode call on the whole corpus (no per-request latency).", "",
             "| system | seconds | texts/s | p50 ms | p99 ms | vs in-process | failed | min cosine vs in-process |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cos = "(reference)" if r["min_cosine"] is None else f"{r['min_cosine']:.7f}"
        lines.append(f"| {r['system']} | {r['seconds']:.2f} | {r['texts_per_s']:.1f} | {ms(r['p50_ms'])} | "
                     f"{ms(r['p99_ms'])} | {r['texts_per_s'] / ceiling:.2f} | {r['failed']} | {cos} |")
    cpp, py = rows[0], rows[1]
    lines += ["", f"C++ / Python client throughput: {cpp['texts_per_s'] / py['texts_per_s']:.2f}x."]
    for r in rows:
        if r.get("errors"):
            lines.append(f"{r['system']} errors (first): {r['errors'][0]}")
    return "\n".join(lines) + "\n"


def serve_and_measure(args, bundle: Path, corpus: list[str]) -> list[dict]:
    from serve_helpers import ServeCommand, build_cpp_client

    build = args.cpp_build or build_cpp_client(CACHE / "build")
    log(f"in-process run ({len(corpus)} texts)")
    ours, want = in_process(bundle, corpus)
    if args.url:
        url, model, served = args.url, args.model, None
    else:
        log("starting mbert-run serve")
        served = ServeCommand(bundle).start().wait_ready()
        url, model = served.http_url, served.model
    try:
        log(f"C++ client run ({args.clients} clients)")
        cpp, cpp_vectors = cpp_client(build, url, model, corpus, args.clients)
        log(f"C++: {cpp['seconds']:.2f}s; Python client run ({args.clients} clients)")
        py, py_vectors = python_client(url, model, corpus, args.clients)
        log(f"Python: {py['seconds']:.2f}s")
    finally:
        if served is not None:
            served.stop()
    return [finish(cpp, cpp_vectors, want), finish(py, py_vectors, want), finish(ours, None, want)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, short run (smoke test)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients per served system (default 16)")
    ap.add_argument("--out", type=Path, default=None, help="the .md report (the .json goes beside it)")
    ap.add_argument("--bundle", type=Path, default=None, help="this bundle instead of the cached one")
    ap.add_argument("--url", default=None, help="an already served bundle's HTTP endpoint (needs --model, --bundle)")
    ap.add_argument("--model", default=None, help="the served ensemble's name")
    ap.add_argument("--cpp-build", type=Path, default=None, help="an already built clients/cpp build folder")
    args = ap.parse_args()
    if args.url and not (args.model and args.bundle):
        ap.error("--url needs --model and --bundle (the served bundle, for the in-process reference)")
    spec = QUICK if args.quick else FULL
    args.load = os.getloadavg()[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.bundle:
        bundle = args.bundle
        args.model_label = f"the bundle {bundle.name}"
    elif args.quick:
        from triton_serve import CACHE as SERVE_CACHE
        from triton_serve import quick_bundle

        bundle = quick_bundle(SERVE_CACHE)
        args.model_label = "random gte-modernbert-base-shaped, the tests' 2-layer TINY (smoke test, not the target size)"
    else:
        _, bundle = prepare(spec["max_len"])
        args.model_label = "random full-size gte-modernbert-base weights (22 layers, hidden 768, CLS pooling)"
    corpus = build_corpus(bundle / "tokenizer.json", spec)
    rows = serve_and_measure(args, bundle, corpus)
    text = report(args, corpus, rows)
    out = args.out or REPO / "benchmarks" / "results" / ("cpp_client_quick.md" if args.quick else "cpp_client.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        {"quick": args.quick, "clients": args.clients, "texts": len(corpus), "load_average": args.load,
         "model": args.model_label, "rows": rows}, indent=2))
    print(text)
    log(f"wrote {out} and {out.with_suffix('.json').name}")


if __name__ == "__main__":
    main()
