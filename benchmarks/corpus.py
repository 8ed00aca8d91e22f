#!/usr/bin/env python
"""The corpus job (``mbert-run embed --output DIR/``): peak memory against corpus size, throughput
against in-process ``Encoder.encode``, Ray Data with 2 actors x 1 thread, and the cost of a resume.

Every measurement runs in its own subprocess (peak RSS is the child's ``ru_maxrss``) on one corpus of
short texts (6-30 tokens, cut from the built-in calibration texts):

  rss      the single-process job on the small and the large corpus (the job's memory is one window:
           the two peaks should be within 10 %)
  encode   Encoder.encode(all texts) in one call, texts in memory: the throughput reference
  job      the single-process job on the speed corpus
  ray      the same job on a local Ray cluster (its own network namespace; 2 actors x 1 thread);
           the time is the command's, actor start-up included, cluster start-up excluded
  resume   the job killed (SIGKILL) after half its shards, then rerun: the rerun's time beyond the half
           it had left

    python benchmarks/corpus.py           # full-size bundle (ModernBERT-base shape, random weights)
    python benchmarks/corpus.py --quick   # tiny bundle, 200 / 2,000 / 200 texts, window 100, seconds
                                          # -> results/corpus_quick.md

The full-size bundle is the one benchmarks/runtime_cpu.py builds (cached in benchmarks/.cache/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests")]
# (small, large, speed) corpus sizes; window = rows per shard
FULL = dict(small=10_000, large=200_000, speed=4_000, window=1024, max_len=512)
QUICK = dict(small=200, large=2_000, speed=200, window=100, max_len=128)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tiny_bundle(root: Path, max_len: int) -> Path:
    """The tests' 2-layer ``helpers.TINY`` with mean pooling and Normalize, exported at ``max_len``."""
    from helpers import TINY, make_checkpoint

    from mbert.export.options import ExportOptions
    from mbert.export.pipeline import export_bundle

    ck = make_checkpoint(root / "checkpoint", base="gte-modernbert-base", layout="mean-normalize", seed=2, **TINY)
    bundle = root / "bundle"
    export_bundle(ck, ExportOptions(out=bundle, max_seq_len=max_len, engine="none"))
    return bundle


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    """``n`` short texts: word runs of 4-28 words from the calibration texts."""
    from mbert.bundle.texts import calibration_texts

    words = " ".join(calibration_texts()).split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            k = rng.randint(4, 28)
            start = rng.randrange(0, len(words) - k)
            f.write(f"{i} " + " ".join(words[start:start + k]) + "\n")


# --- children ----------------------------------------------------------------------------------

def child(mode: str, bundle: str, corpus: str, out: str, window: int, stop_after: int) -> None:
    from mbert.runtime import Encoder

    enc = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
    info: dict = {}
    with open(corpus, encoding="utf-8") as f:  # the same warm-up for both: ONNX Runtime's first runs
        enc.encode([line.rstrip("\n") for _, line in zip(range(64), f)])  # allocate its arenas
    t0 = time.perf_counter()
    if mode == "encode":
        texts = Path(corpus).read_text(encoding="utf-8").splitlines()
        t0 = time.perf_counter()
        enc.encode(texts)
        info.update(tokens=enc.last_stats.tokens, rows=len(texts))
    else:
        from mbert.runtime.corpus import embed_corpus, shards

        if stop_after:  # kill -9 right after the record counts this many shards
            real = shards.write_record

            def write_record(folder, record):
                real(folder, record)
                if record.shards == stop_after:
                    os.kill(os.getpid(), 9)

            shards.write_record = write_record
        s = embed_corpus(enc, corpus, out, window=window)
        info.update(tokens=s.tokens, rows=s.added_rows, resumed_at=s.resumed_at)
    info["seconds"] = time.perf_counter() - t0
    info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(info))


def measure(mode: str, bundle: Path, corpus: Path, out: Path, window: int, stop_after: int = 0) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(bundle), str(corpus), str(out), str(window),
                           str(stop_after)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if stop_after:
        return {"wall_s": wall, "returncode": done.returncode}
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), wall_s=wall)


def measure_ray(bundle: Path, corpus: Path, work: Path, window: int) -> dict:
    from ray_helpers import ADDRESS, ray_session

    cmd = [sys.executable, "-c", "import sys, time, json; from mbert.runtime.cli import main; t = time.perf_counter()\n"
           "try:\n    main()\nfinally:\n    print(json.dumps({'seconds': time.perf_counter() - t}))",
           "embed", str(bundle), "--input", str(corpus), "--output", f"{work / 'ray-out'}/", "--ray", ADDRESS,
           "--actors", "2", "--threads-per-actor", "1", "--window", str(window), "--backend", "onnxruntime"]
    # the same command on the corpus's first 64 texts first, in the same cluster: its time is the Ray job's
    # fixed cost (driver start, Ray Data planning, actors opening the bundle), told apart from the rate
    first = work / "ray-first.txt"
    with open(corpus, encoding="utf-8") as f:
        first.write_text("".join(line for _, line in zip(range(64), f)), encoding="utf-8")
    fixed = [str(first) if a == str(corpus) else f"{work / 'ray-first-out'}/" if a.endswith("ray-out/") else a
             for a in cmd] + ["--overwrite"]
    results = ray_session(work, [("ray-fixed", fixed), ("ray", cmd + ["--overwrite"])], timeout=3000)
    out = {}
    for name, key in (("ray-fixed", "fixed_s"), ("ray", "seconds")):
        rc, stdout, err = results[name]
        if rc != 0:
            return {"error": (err or results["session"])[-2000:]}
        out[key] = json.loads(stdout.strip().splitlines()[-1])["seconds"]
    counted = re.search(r"\((\d+) tokens", results["ray-fixed"][2])  # the summary line: "embedded N texts (T tokens"
    out["fixed_tokens"] = int(counted.group(1)) if counted else 0
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# --- the run -------------------------------------------------------------------------------------

def run(args, work: Path) -> dict:
    spec = dict(QUICK if args.quick else FULL)
    for k in ("small", "large", "speed"):
        if getattr(args, k):
            spec[k] = getattr(args, k)
    if args.bundle:
        bundle = args.bundle
        model = f"the bundle {bundle}"
    elif args.quick:
        bundle = tiny_bundle(work / "bundles", spec["max_len"])
        model = f"tiny (the tests' TINY: 2 layers, hidden 128, max {spec['max_len']} tokens)"
    else:
        from runtime_cpu import prepare

        _, bundle = prepare(spec["max_len"])
        model = f"full size (gte-modernbert-base shape: 22 layers, hidden 768; max {spec['max_len']} tokens)"
    spec["rss_window"] = spec["window"]
    if args.window:
        spec["window"] = args.window
    rss_bundle, spec["rss_model"] = bundle, model
    if args.rss_tiny and not args.quick:  # full size at 200k texts takes hours on a small CPU
        rss_bundle = tiny_bundle(work / "bundles", 128)
        spec["rss_model"] = "tiny (the tests' TINY: 2 layers, hidden 128, max 128 tokens)"
    result = {"model": model, "spec": spec, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "uptime_start": uptime()}
    window = spec["window"]
    rss = {}
    for name in ("small", "large"):
        corpus = work / f"{name}.txt"
        write_corpus(corpus, spec[name])
        log(f"rss: the job on {spec[name]} texts")
        rss[name] = measure("job", rss_bundle, corpus, work / f"out-{name}", spec.get("rss_window", window))
    result["rss"] = rss
    speed = work / "speed.txt"
    write_corpus(speed, spec["speed"], seed=1)
    reps = []
    for k in range(args.repeats):  # interleaved, so the machine's load falls on each system alike
        log(f"speed {k + 1}/{args.repeats}: Encoder.encode, the job{', Ray' if args.ray else ''} on {spec['speed']} texts")
        one = {"encode": measure("encode", bundle, speed, work / "unused", window),
               "job": measure("job", bundle, speed, work / "out-speed", window)}
        shutil.rmtree(work / "out-speed", ignore_errors=True)
        if args.ray:
            one["ray"] = measure_ray(bundle, speed, work, window)
        reps.append(one)
    result["reps"] = reps
    result["encode"], result["job"] = reps[-1]["encode"], reps[-1]["job"]  # next to the resume runs
    shards_total = -(-spec["speed"] // window)
    half = max(1, shards_total // 2)
    log(f"resume: killed after {half} of {shards_total} shards, then rerun")
    killed = measure("job", bundle, speed, work / "out-resume", window, stop_after=half)
    resumed = measure("job", bundle, speed, work / "out-resume", window)
    left = (spec["speed"] - resumed["resumed_at"]) / spec["speed"]
    result["resume"] = dict(killed=killed, resumed=resumed, share_left=left,
                            overhead_s=resumed["wall_s"] - left * result["job"]["wall_s"])
    result["uptime_end"] = uptime()
    return result


def table(r: dict) -> str:
    rss, job, spec = r["rss"], r["job"], r["spec"]
    flat = rss["large"]["peak_rss_mb"] / rss["small"]["peak_rss_mb"] - 1
    rows = ["# Corpus job: memory, throughput, resume\n",
            f"{r['date']}, {r['machine']}; bundle: {r['model']}; window {r['spec']['window']} texts; ONNX Runtime "
            f"CPU FP32; short texts (4-28 words).\n",
            f"Peak RSS on bundle: {spec.get('rss_model', r['model'])}, window {spec.get('rss_window', spec['window'])}. "
            f"Load at start: `{r.get('uptime_start', '?')}`; at end: `{r.get('uptime_end', '?')}`.\n",
            "| measure | value | against |", "|---|---|---|",
            f"| peak RSS, job on {rss['small']['rows']:,} texts | {rss['small']['peak_rss_mb']:.0f} MB | |",
            f"| peak RSS, job on {rss['large']['rows']:,} texts | {rss['large']['peak_rss_mb']:.0f} MB | "
            f"{100 * flat:+.1f} % (target: within 10 %) |",
            *throughput_rows(r)]
    res = r["resume"]
    rows.append(f"| resume overhead (rerun after kill -9 at half) | {res['overhead_s']:.2f} s | rerun "
                f"{res['resumed']['wall_s']:.2f} s for {100 * res['share_left']:.0f} % of an uninterrupted "
                f"{job['wall_s']:.2f} s (process wall times) |")
    return "\n".join(rows) + "\n"


def throughput_rows(r: dict) -> list[str]:
    """Per round: each system's tokens/s and its ratio to that round's Encoder.encode."""
    tps = lambda m, s=None: m["tokens"] / (s if s is not None else m["seconds"])  # noqa: E731
    rows = []
    for k, one in enumerate(r.get("reps") or [{"encode": r["encode"], "job": r["job"]}], 1):
        enc, job, ray = one["encode"], one["job"], one.get("ray")
        rows += [f"| round {k}: tokens/s, Encoder.encode in process ({enc['rows']:,} texts) | {tps(enc):,.0f} | 1.00x |",
                 f"| round {k}: tokens/s, single-process job | {tps(job):,.0f} | {tps(job) / tps(enc):.2f}x |"]
        if ray and "seconds" in ray:
            rt, beyond = tps(job, ray["seconds"]), ray["seconds"] - ray["fixed_s"]
            rate = (job["tokens"] - ray.get("fixed_tokens", 0)) / beyond if beyond > 0 else 0.0  # the rest's tokens
            steady = (f"{rate:,.0f} | {rate / tps(enc):.2f}x" if beyond > 0 else
                      "not measurable: the whole run took no longer than the 64 texts | ")
            rows += [f"| round {k}: tokens/s, Ray 2 actors x 1 thread (command wall time, actor start-up included) | "
                     f"{rt:,.0f} | {rt / tps(enc):.2f}x |",
                     f"| round {k}: Ray fixed cost (the same command on 64 texts, run first) | {ray['fixed_s']:.1f} s | |",
                     f"| round {k}: tokens/s, Ray on the texts after the first 64 (time and tokens beyond "
                     f"the 64-text run) | {steady} |"]
        elif ray:
            rows.append(f"| round {k}: Ray 2 actors x 1 thread | failed: {' '.join(ray['error'].split())[-300:]} | |")
    if not any("ray" in one for one in r.get("reps", [])):
        rows.append("| tokens/s, Ray 2 actors x 1 thread | not run (--ray not given) | |")
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, bundle, corpus, out, window, stop = sys.argv[2:8]
        child(mode, bundle, corpus, out, int(window), int(stop))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny bundle and corpora: seconds")
    ap.add_argument("--ray", action="store_true", help="also run the Ray job (a local cluster in a network namespace)")
    ap.add_argument("--small", type=int, help="texts in the small corpus")
    ap.add_argument("--large", type=int, help="texts in the large corpus")
    ap.add_argument("--speed", type=int, help="texts in the throughput corpus")
    ap.add_argument("--window", type=int, help="texts a window (rows a shard) in the throughput and resume runs")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of encode, job, Ray (interleaved)")
    ap.add_argument("--rss-tiny", action="store_true", help="the RSS comparison on the tiny bundle (full size is hours)")
    ap.add_argument("--out", type=Path, help="the table (default results/corpus[_quick].md; JSON beside it)")
    ap.add_argument("--bundle", type=Path, help="measure this bundle instead (the smoke test passes its module's)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="corpus-bench-"))
    try:
        result = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = args.out or REPO / "benchmarks" / "results" / ("corpus_quick.md" if args.quick else "corpus.md")
    out.write_text(table(result), encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(table(result))


if __name__ == "__main__":
    main()
