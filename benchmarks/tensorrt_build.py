#!/usr/bin/env python
"""TensorRT-RTX engine builds of full-size ModernBERT-base on this (GPU-less) machine: build time,
engine size and builder peak memory, FP16 (this project's mixed-precision graph) and FP32.

One seeded random full-size ModernBERT-base checkpoint (22 layers, built with the test helper;
shared with onnx_cpu.py in benchmarks/.cache/), exported once:

  fp32   mbert.export.onnx.trace.to_onnx(load_model(folder), max_seq_len=8192)    (the standard-ops form,
         target "tensorrt": the bundle's model.onnx is ONNX Runtime's fused form, TensorRT cannot parse it)
  fp16   scan -> plan -> to_mixed_precision -> to_onnx, as the pipeline does   (model.fp16.onnx)

Every build runs in a fresh subprocess that imports TensorRT-RTX, parses the graph, builds it with
the pipeline's default profile (batch 1..32, sequence 1..8192, opt 16 x 512) for TensorRT-RTX's
portable targets (8.0, 8.6, 8.9, 12.0), and reports: parse seconds, builder seconds
(build_serialized_network), their sum, the plan's size, and the child's peak RSS (ru_maxrss, which
includes the parsed network and the weights the builder copies) next to its RSS after parsing;
GB = 1e9 bytes.
The FP16 child also runs the precision walk and its table goes into the report.

    python benchmarks/tensorrt_build.py                        # full size -> results/tensorrt_build.md
    python benchmarks/tensorrt_build.py --quick --out /tmp/x   # smoke test: the tests' 2-layer TINY model, one 2 x 64 profile

Targets: full-size FP16 engine built in <= 60 s, builder peak memory <= 4 GB.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import resource
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp16", "fp32")
TARGET_SECONDS, TARGET_GB = 60.0, 4.0


def paths(cache: Path, quick: bool) -> dict[str, Path]:
    if quick:
        root = cache / "trt-tiny"
        return {"ckpt": root / "ckpt", "fp32": root / "model.onnx", "fp16": root / "model.fp16.onnx",
                "plan": root / "plan.json"}
    return {"ckpt": cache / "modernbert-base-random", "fp32": cache / "onnx-ours" / "model.onnx",
            "fp16": cache / "trt" / "model.fp16.onnx", "plan": cache / "trt" / "plan.json"}


def export_child(what: str, cache: Path, quick: bool, max_seq: int) -> None:
    """Build the checkpoint or one graph into the cache (run in a subprocess)."""
    p = paths(cache, quick)
    sys.path.insert(0, str(REPO / "tests"))
    if what == "checkpoint":
        from helpers import TINY, make_checkpoint

        make_checkpoint(p["ckpt"], "modernbert-base", seed=0, **(TINY if quick else {}))
        return
    from mbert.export.onnx.trace import to_onnx
    from mbert.modeling import load_model

    model = load_model(p["ckpt"])
    if what == "fp32":
        to_onnx(model, p["fp32"], max_seq_len=max_seq)
        return
    from mbert.bundle.texts import calibration_texts
    from mbert.export.fp16.precision import plan, scan, to_mixed_precision

    the_plan = plan(scan(model, calibration_texts(), max_len=min(512, max_seq)))
    to_onnx(to_mixed_precision(model, the_plan), p["fp16"], max_seq_len=max_seq)
    p["plan"].write_text(json.dumps(the_plan.to_dict(), indent=2))


def build_child(precision: str, cache: Path, quick: bool, max_batch: int, max_seq: int,
                workspace_gib: float | None) -> None:
    """Parse and build one graph with TensorRT-RTX as the export's engine stage does (and walk the FP16
    network against its plan); print one JSON line (run in a subprocess)."""
    t0 = time.perf_counter()
    import tensorrt_rtx  # noqa: F401

    from mbert.export.tensorrt.build import build_log_text, build_parsed, parse_onnx, profiles_from

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = paths(cache, quick)
    out = cache / ("trt-tiny" if quick else "trt") / f"engine-{precision}"
    parsed = parse_onnx(p[precision], "tensorrt-rtx")
    parse_s = time.perf_counter() - t0
    rss_parsed_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    built = build_parsed(parsed, p[precision], out / "model.plan", profiles_from(max_batch, max_seq),
                         workspace_gib=workspace_gib)
    activation = [int(m.group(1)) for m in re.finditer(r"Total Activation Memory: (\d+) bytes", build_log_text(built))]
    result = {"precision": precision, "import_s": import_s, "parse_s": parse_s, "build_s": built.seconds,
              "plan_mb": built.plan.stat().st_size / 1e6, "rss_parsed_gb": rss_parsed_kb * 1024 / 1e9,
              "layers": parsed.network.num_layers, "version": built.version, "targets": list(built.targets),
              "activation_gb": max(activation) / 1e9 if activation else None,
              "workspace_gib": built.options.workspace_gib, "profiles": [str(x) for x in built.profiles]}
    if precision == "fp16":  # the walk runs over the network just built, as in the export's engine stage
        from mbert.bundle.schema import to_json
        from mbert.export.fp16.precision import Plan
        from mbert.export.tensorrt.precision import walk_parsed

        t1 = time.perf_counter()
        walk, _ = walk_parsed(parsed, Plan.from_dict(json.loads(p["plan"].read_text())))
        result.update(walk_s=time.perf_counter() - t1, walk_passed=walk.passed, walk_table=walk.table(),
                      walk_network=to_json(walk.network))
    del parsed
    (out / "model.plan").unlink()  # hundreds of MB; the numbers are what this script keeps
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux
    result["children_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    print(json.dumps(result))


def prepare(args) -> None:
    p = paths(args.cache, args.quick)
    todo = [("checkpoint", p["ckpt"] / "special_tokens_map.json"), ("fp32", p["fp32"]), ("fp16", p["plan"])]
    for what, marker in todo:  # the last file each step writes marks it finished
        if marker.exists():
            continue
        print(f"building {what} -> {marker} ...", flush=True)
        cmd = [sys.executable, __file__, "--export", what, "--cache", str(args.cache), "--max-seq", str(args.max_seq)]
        if subprocess.run(cmd + (["--quick"] if args.quick else [])).returncode != 0:
            raise SystemExit(f"building {what} failed; see the log above")


def run_build(args, precision: str) -> dict:
    cmd = [sys.executable, __file__, "--child", precision, "--cache", str(args.cache), "--max-seq", str(args.max_seq),
           "--max-batch", str(args.max_batch)] + (["--quick"] if args.quick else []) \
        + (["--workspace-gib", str(args.workspace_gib)] if args.workspace_gib is not None else [])
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"precision": precision, "status": f"failed (exit {proc.returncode}): {err[:300]}"}
    result = json.loads(lines[-1])
    result.update(status="ok", child_wall_s=wall)
    return result


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> str:
    packages = ("mbert-export", "tensorrt-rtx-cu12", "torch", "onnx", "onnxscript")
    return f"python {platform.python_version()}, " + ", ".join(f"{p} {_installed(p)}" for p in packages)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{cpu}, {len(__import__('os').sched_getaffinity(0))} CPUs, {mem / 2**20:.0f} GiB, load {' '.join(load)}"


def workspace_read(results: list[dict]) -> str:
    limits = sorted({r["workspace_gib"] for r in results if r.get("status") == "ok"})
    return "read back: " + ", ".join(f"{x:g} GiB" for x in limits) if limits else "not read back"


def report(args, results: list[dict]) -> list[str]:
    size = "2-layer TINY test model (--quick)" if args.quick else "full-size ModernBERT-base (22 layers, random weights)"
    lines = [f"# TensorRT-RTX engine builds: {size}", "",
             f"{datetime.date.today()}, {machine()}, no GPU. {versions()}",
             "", f"Profile: batch 1..{args.max_batch}, sequence 1..{args.max_seq}"
             + ("" if args.quick else " (the pipeline's default)") + ", workspace limit "
             + (f"{args.workspace_gib:g} GiB" if args.workspace_gib is not None else
                "TensorRT's own (the pipeline's default; " + workspace_read(results) + ")") + "; "
             "targets: TensorRT-RTX's portable set. "
             "Each build in a fresh process; parse s excludes importing Python modules (import s).", "",
             "| graph | import s | parse s | builder s | parse + build s | plan MB | engine activation GB | "
             "RSS after parse GB | peak RSS GB | TensorRT layers |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['precision']} | {r['status']} | | | | | | | | |")
            continue
        lines.append(f"| {r['precision']} | {r['import_s']:.1f} | {r['parse_s']:.1f} | {r['build_s']:.1f} | {r['parse_s'] + r['build_s']:.1f} "
                     f"| {r['plan_mb']:.0f} | {r['activation_gb'] or float('nan'):.2f} | {r['rss_parsed_gb']:.2f} | {r['peak_rss_gb']:.2f} | {r['layers']} |")
    ok = {r["precision"]: r for r in results if r["status"] == "ok"}
    if {"fp16", "fp32"} <= set(ok):
        a, b = ok["fp16"], ok["fp32"]
        lines += ["", f"FP16 / FP32: build time {(a['parse_s'] + a['build_s']) / (b['parse_s'] + b['build_s']):.2f}x, "
                  f"plan size {a['plan_mb'] / b['plan_mb']:.2f}x, peak RSS {a['peak_rss_gb'] / b['peak_rss_gb']:.2f}x."]
    if "fp16" in ok:
        a = ok["fp16"]
        secs, peak = a["parse_s"] + a["build_s"], a["peak_rss_gb"]
        lines += ["", "| target | measured | met |", "|---|---|---|",
                  f"| FP16 engine built (parse + build) <= {TARGET_SECONDS:.0f} s | {secs:.1f} s | "
                  f"{'yes' if secs <= TARGET_SECONDS else 'no'} |",
                  f"| builder peak memory <= {TARGET_GB:.0f} GB | {peak:.2f} GB | {'yes' if peak <= TARGET_GB else 'no'} |"]
        if "walk_table" in a:
            lines += ["", f"Precision walk of the FP16 graph ({a['walk_s']:.1f} s; network: {a['walk_network']}):", "",
                      "```", *a["walk_table"], "```"]
    if args.quick:
        lines += ["", "Smoke test only: not a measurement of the full-size targets."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: the tests' 2-layer TINY model, batch 1..2, sequence 1..64")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--cache", type=Path, default=REPO / "benchmarks" / ".cache")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of fp16, fp32")
    ap.add_argument("--max-batch", type=int)
    ap.add_argument("--max-seq", type=int)
    ap.add_argument("--workspace-gib", type=float, default=None,
                    help="builder workspace limit (default: none set, TensorRT's own, as the export does); a limit "
                         "must hold the engine's activation memory at the largest shape (FP16 needed 4.59 GB at "
                         "32 x 8192; FP32 did not fit in 8 GiB)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per build child")
    ap.add_argument("--child", choices=PRECISIONS, help=argparse.SUPPRESS)
    ap.add_argument("--export", choices=("checkpoint", "fp32", "fp16"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.max_batch = args.max_batch or (2 if args.quick else 32)
    args.max_seq = args.max_seq or (64 if args.quick else 8192)
    if args.export:
        return export_child(args.export, args.cache, args.quick, args.max_seq)
    if args.child:
        return build_child(args.child, args.cache, args.quick, args.max_batch, args.max_seq, args.workspace_gib)
    prepare(args)
    results = [run_build(args, p) for p in args.precisions.split(",")]
    lines = report(args, results)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "tensorrt_build_quick" if args.quick else "tensorrt_build"
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out / (name + '.md')}")


if __name__ == "__main__":
    main()
