#!/usr/bin/env python
"""Served throughput: a real Triton server (nvidia-pytriton's tritonserver, Python backend, CPU)
on the bundle's repository against ``Encoder.encode`` in-process, on the same texts.

  in-process  Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(corpus)
              (one call: the runtime sorts the whole corpus by length and batches it)
  served      the models ``mbert-run serve`` loads (ensemble -> tokenizer -> ONNX Runtime in the
              Python backend), C concurrent clients on loopback (half HTTP, half gRPC), one text
              per request, each client taking the next text of the corpus until it is done; the
              server batches across requests (Triton's dynamic batcher + the runtime's batching)

Target: served >= 80% of in-process texts/s at saturating load on the 2-core build
machine. The served vectors are checked against the in-process ones (min cosine). Triton's
statistics give the batches the encoder ran (inference count / execution count).

    python benchmarks/triton_serve.py            # full-size random gte-modernbert-base, 120 texts
                                                 # up to 512 tokens -> results/triton_serve.md
    python benchmarks/triton_serve.py --quick    # the tests' 2-layer TINY model, 40 short texts
                                                 # (smoke test) -> results/triton_serve_quick.md
    --out FILE: the report elsewhere; --cache DIR: the quick model's folder (tests use both)

The server runs, as ``mbert-run serve`` does, on a private serving copy of the opened bundle's own
repository (the sealed bundle is never modified). The full-size checkpoint and bundle are shared with
runtime_cpu.py (benchmarks/.cache/runtime_cpu/); the quick model lives in
benchmarks/.cache/triton_serve/. Run on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from runtime_cpu import build_corpus, log, prepare  # noqa: E402

from mbert.bundle.names import TOKENIZER  # noqa: E402

CACHE = REPO / "benchmarks" / ".cache" / "triton_serve"
FULL = dict(max_len=512, buckets=[("query", 60, 6, 30), ("passage", 40, 60, 300),
                                  ("document", 20, 300, 512)])
# --quick: 40 short texts (documents past max_len, so truncation runs), enough for every client
QUICK = dict(max_len=128, buckets=[("query", 24, 6, 30), ("passage", 12, 40, 120), ("document", 4, 100, 200)])
TARGET = 0.80


def quick_bundle(cache: Path) -> Path:
    """The tiny model's bundle (cached in ``cache``; exported again when it does not open, e.g. one
    written by an older format), for smoke runs."""
    from helpers import TINY, make_checkpoint

    from mbert.bundle import open_bundle
    from mbert.bundle.errors import MbertError
    from mbert.export.pipeline import ExportOptions, export_bundle

    bundle = cache / "bundle-tiny"
    try:
        open_bundle(bundle).close()
        return bundle
    except MbertError:
        pass
    ck = cache / "checkpoint-tiny"
    if not (ck / "special_tokens_map.json").is_file():  # written last by make_checkpoint
        make_checkpoint(ck, base="gte-modernbert-base", layout="cls-pooling", seed=0, **TINY)
    log("exporting the tiny bundle")
    export_bundle(ck, ExportOptions(out=bundle, max_seq_len=QUICK["max_len"], overwrite=True))
    return bundle


def in_process(bundle: Path, corpus: list[str]) -> tuple[float, np.ndarray, dict]:
    from mbert.runtime import Encoder

    enc = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc.encode(corpus[:8])  # warm-up
        t0 = time.perf_counter()
        vectors = enc.encode(corpus)
        seconds = time.perf_counter() - t0
    s = enc.last_stats
    return seconds, vectors, {"batches": s.batches, "padded_tokens": s.padded_tokens, "tokens": s.tokens}


def drain(make_client, corpus: list[str], clients: int) -> tuple[list, list[float], list[str], float]:
    """``clients`` threads, each with its own ``make_client(c)`` (a TritonEncoder, made in the thread),
    each encoding the next text of ``corpus`` alone until none is left: (vectors by text, None where
    it failed; latencies in s; errors; wall seconds)."""
    results: list = [None] * len(corpus)
    latencies: list[float] = []
    errors: list[str] = []
    cursor = iter(range(len(corpus)))
    lock = threading.Lock()

    def loop(c: int) -> None:
        enc = make_client(c)
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                vec = enc.encode([corpus[i]])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"text {i}: {exc}")
                continue
            dt = time.perf_counter() - t0
            with lock:
                results[i] = vec[0]
                latencies.append(dt)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, latencies, errors, time.perf_counter() - t0


def served(bundle: Path, corpus: list[str], clients: int, log_file: Path) -> dict:
    from mbert.bundle import open_bundle
    from mbert.runtime.serve.folder import serve_folder
    from mbert.runtime.serve.repository import ensemble_models, serving_copy
    from mbert.runtime.serve.server import TritonServer

    with serve_folder() as workdir, open_bundle(bundle) as opened:
        repo = serving_copy(opened, None, workdir)  # as mbert-run serve: the sealed bundle stays as it is
        opened.close()
        with TritonServer(repo, models=ensemble_models(repo), log=log_file) as server:
            return drain_served(server, corpus, clients)


def drain_served(server, corpus: list[str], clients: int) -> dict:
    """Warm the server up, then :func:`drain` ``corpus`` through it with ``clients`` clients."""
    import tritonclient.http

    from mbert.runtime import TritonEncoder

    name = TritonEncoder(server.http_url).model
    python = f"{name}_python"
    stats_client = tritonclient.http.InferenceServerClient(server.http_url)
    warm = TritonEncoder(server.http_url, model=name)
    for text in corpus[:8]:
        warm.encode([text])
    before = stats_client.get_inference_statistics(python)["model_stats"][0]
    results, latencies, errors, seconds = drain(lambda c: TritonEncoder(
        server.http_url if c % 2 == 0 else server.grpc_url, model=name,
        protocol="http" if c % 2 == 0 else "grpc", timeout=600), corpus, clients)
    after = settled_statistics(stats_client, python, before, len(corpus) - len(errors))
    return {"seconds": seconds, "vectors": results, "latencies": np.array(latencies), "errors": errors,
            "inferences": after["inference_count"] - before["inference_count"],
            "executions": after["execution_count"] - before["execution_count"], "clients": clients}


def settled_statistics(client, model: str, before: dict, expected: int, timeout_s: float = 30.0) -> dict:
    """``model``'s statistics once its inference count has grown by ``expected`` (Triton counts a request
    after sending its response), or as they stand after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get_inference_statistics(model)["model_stats"][0]
        if stats["inference_count"] - before["inference_count"] >= expected or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def report(args, corpus, lengths, ours, srv, vectors) -> str:
    from mbert import export

    capped = sum(min(n, args.max_len) for n in lengths)
    seconds, _, info = ours
    ok = [i for i, v in enumerate(srv["vectors"]) if v is not None]
    got = np.stack([srv["vectors"][i] for i in ok]) if ok else np.zeros((0, vectors.shape[1]))
    want = vectors[ok]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)) if ok else [0.0]
    lat = srv["latencies"] * 1000 if len(srv["latencies"]) else np.zeros(1)
    ratio = seconds / srv["seconds"]
    lines = [f"# Served (Triton) vs in-process throughput on CPU{' (--quick)' if args.quick else ''}", "",
             f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}, mbert-export {export.__version__}, "
             "tritonserver 2.51.0 (nvidia-pytriton 0.7.0), Python backend only. Load average at the "
             f"start: {args.load:.1f} (numbers mean little unless it is near 0).",
             f"Model: {args.model}.",
             f"Corpus: {len(corpus)} texts cut from the built-in calibration set, {capped} tokens "
             f"(lengths {min(lengths)}..{max(lengths)}), max length {args.max_len}.",
             f"Served: {srv['clients']} concurrent clients on loopback (half HTTP, half gRPC), one text per "
             "request, the corpus once; in-process: one Encoder.encode call on the whole corpus "
             "(batch_size 32), after a warm-up.", "",
             "| system | seconds | texts/s | tokens/s | vs in-process |", "|---|---|---|---|---|",
             f"| in-process Encoder.encode | {seconds:.2f} | {len(corpus) / seconds:.1f} | {capped / seconds:.0f} | 1.00 |",
             f"| served (Triton) | {srv['seconds']:.2f} | {len(corpus) / srv['seconds']:.1f} | "
             f"{capped / srv['seconds']:.0f} | {ratio:.2f} |", "",
             f"Target: served >= {TARGET:.0%} of in-process: **{'met' if ratio >= TARGET else 'MISSED'}** "
             f"({ratio:.0%}).",
             f"Served latency per request: p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms. "
             f"Failed requests: {len(srv['errors'])}{' (' + srv['errors'][0] + ')' if srv['errors'] else ''}.",
             f"Triton statistics of the encoder model: {srv['inferences']} inferences in {srv['executions']} "
             f"executions (mean batch {srv['inferences'] / max(1, srv['executions']):.2f} requests).",
             f"In-process: {info['batches']} batches, {info['padded_tokens']} padded tokens for {info['tokens']}.",
             f"Served vs in-process vectors: min cosine {float(np.min(cos)):.7f} over {len(ok)} texts."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 40 texts at 128 tokens (smoke test)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--out", type=Path, default=None, help="the report (default benchmarks/results/...)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="the quick model's folder")
    ap.add_argument("--bundle", type=Path, help="serve this bundle instead (the smoke test passes a shared one)")
    args = ap.parse_args()
    spec = QUICK if args.quick else FULL
    args.max_len, args.load = spec["max_len"], os.getloadavg()[0]
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.bundle:
        bundle = args.bundle
        args.model = f"the bundle {bundle.name}"
    elif args.quick:
        bundle = quick_bundle(args.cache)
        args.model = "random gte-modernbert-base-shaped, the tests' 2-layer TINY (smoke test, not the target size)"
    else:
        _, bundle = prepare(spec["max_len"])
        args.model = "random full-size gte-modernbert-base weights (22 layers, hidden 768, CLS pooling)"
    corpus = build_corpus(bundle / TOKENIZER, spec)
    from tokenizers import Tokenizer

    lengths = [len(e.ids) for e in Tokenizer.from_file(str(bundle / TOKENIZER)).encode_batch(corpus)]
    log(f"corpus: {len(corpus)} texts, {sum(lengths)} tokens; in-process run")
    ours = in_process(bundle, corpus)
    log(f"in-process: {ours[0]:.2f}s; served run ({args.clients} clients)")
    srv = served(bundle, corpus, args.clients, args.cache / "tritonserver.log")
    log(f"served: {srv['seconds']:.2f}s")
    text = report(args, corpus, lengths, ours, srv, ours[1])
    out = args.out or REPO / "benchmarks" / "results" / ("triton_serve_quick.md" if args.quick else "triton_serve.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
