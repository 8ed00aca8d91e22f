#!/usr/bin/env python
"""Where the time of ``mbert-export --fp16`` goes, stage by stage, before and after, in one run.

The pipeline (``mbert.export.pipeline.export_bundle``, as ``mbert-export --fp16 --no-engine`` runs
it) exports one seeded random full-size ModernBERT-base checkpoint (22 layers, built with the test
helper); each stage's wall time and CPU time (all threads of the process) are recorded from the
pipeline's own stage reports, in a fresh subprocess per system:

  after    this checkout
  before   the same pipeline from another revision (``--before REV``, default: the commit before
           the fused attention and the background traces), extracted with ``git archive`` into the cache

``--device`` applies to ``after`` (the scan and the reference outputs); ``before`` ran them on the CPU.

    python benchmarks/export_time.py                      # full size, before and after -> results/export_time.md
    python benchmarks/export_time.py --quick --out /tmp/x # smoke test: the tests' 2-layer TINY model, 128 tokens
                                                          # (the test runs --systems after: "before" is slow)
    python benchmarks/export_time.py --systems after --device cuda

Targets: end to end <= 240 s on an idle 2-core build machine, scan <= 60 s. CPU time
is shown because wall time on a shared machine means little; the targets are judged on wall time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_REV = "b06b5a7"  # the sequential pipeline with standard-ops attention: the baseline measured against
QUICK_MAX_LEN = 128  # --quick: the bundle's max_seq_len (the full run: the model's 8192 positions)
SYSTEMS = ("before", "after")
TARGET_TOTAL_S, TARGET_SCAN_S = 240.0, 60.0


class Clock:
    """Wall and process CPU time of named stages, from the pipeline's (event, message) reports."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.open: dict[str, tuple[float, float]] = {}
        self.stages: list[dict] = []

    def start(self, name: str) -> None:
        self.open[name] = (time.perf_counter(), time.process_time())

    def stop(self, name: str) -> None:
        w, c = self.open.pop(name)
        self.stages.append({"stage": name, "wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c})

    def report(self, event: str, message: str) -> None:  # the pipeline's Reporter
        if event == "stage":  # "[3/8] validate"
            self.start(message.split("] ", 1)[1])
        elif event in ("done", "started"):  # "validate: 12.3s"; "started": the stage started a background job
            self.stop(message.rsplit(":", 1)[0])
        elif event == "background":  # "trace: 51.2 s wall, 50.8 s CPU": the job's own times (a child process)
            name, times = message.split(": ", 1)
            wall, cpu = (float(part.split()[0]) for part in times.split(", "))
            self.stages.append({"stage": f"{name} (background)", "wall_s": wall, "cpu_s": cpu, "background": True})

    def total(self) -> dict:
        children = sum(s["cpu_s"] for s in self.stages if s.get("background"))
        return {"stage": "total", "wall_s": time.perf_counter() - self.t0,
                "cpu_s": time.process_time() - self.c0 + children}


def child_pipeline(ckpt: Path, out: Path, device: str, max_seq_len: int | None) -> dict:
    import dataclasses

    from mbert.export.pipeline import ExportOptions, export_bundle

    fields = {f.name for f in dataclasses.fields(ExportOptions)}
    if "device" in fields:  # this checkout: --engine none, --device
        options = ExportOptions(out=out, fp16=True, engine="none", overwrite=True, device=device,
                                max_seq_len=max_seq_len)
    else:  # the baseline revision: --no-engine was engine=False, the eager passes ran on the CPU
        options = ExportOptions(out=out, fp16=True, engine=False, overwrite=True, max_seq_len=max_seq_len)
    clock = Clock()
    export_bundle(ckpt, options, clock.report)
    return {"stages": clock.stages + [clock.total()]}


def source_tree(rev: str, cache: Path) -> Path:
    """``rev``'s package as an importable ``mbert`` (git archive + a package of links)."""
    root = cache / f"src-{rev}"
    pkg = root / "pkg" / "mbert"
    if not (pkg / "__init__.py").exists():
        (root / "src").mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root / "src")], input=archive, check=True)
        pkg.mkdir(parents=True, exist_ok=True)
        for name in ("modeling", "export", "runtime"):
            link = pkg / name
            if not link.exists():
                link.symlink_to(root / "src" / name)
        (pkg / "__init__.py").write_text("")
    return root / "pkg"


def checkpoint(cache: Path, quick: bool) -> Path:
    ckpt = cache / ("tiny-random" if quick else "modernbert-base-random")  # shared with onnx_cpu.py
    if not (ckpt / "special_tokens_map.json").exists():  # written last by make_checkpoint
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import TINY, make_checkpoint

        make_checkpoint(ckpt, "modernbert-base", seed=0, **(TINY if quick else {}))
    return ckpt


def run_child(system: str, args) -> dict:
    env = dict(os.environ)
    if system == "before":
        env["PYTHONPATH"] = str(source_tree(args.before, args.cache)) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", system, "--cache", str(args.cache), "--device", args.device]
    cmd += ["--quick"] if args.quick else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"exit {proc.returncode}: {err[:300]}"}
    return {"status": "ok", **json.loads(lines[-1])}


def child(system: str, args) -> None:
    import mbert.export

    ckpt = checkpoint(args.cache, args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        result = child_pipeline(ckpt, Path(tmp) / "bundle", args.device, QUICK_MAX_LEN if args.quick else None)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["child_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # the traces
    result["package"] = str(Path(mbert.export.__file__).parent)
    print(json.dumps(result))


def report(args, res: dict) -> list[str]:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "unknown CPU")
    model = f"SMOKE TEST, the tests' 2-layer TINY random model at {QUICK_MAX_LEN} tokens (--quick): not a result" if args.quick else \
        "ModernBERT-base (random weights, 22 layers), built-in calibration texts (~30k tokens)"
    L = [f"# `mbert-export --fp16 --no-engine`, stage by stage: {model}\n",
         f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
         f"- machine: {cpu}, {os.cpu_count()} logical CPUs; load average at start {args.load:.2f}",
         f"- torch {torch.__version__}; device for the eager steps: {args.device}",
         f"- before: revision {args.before} (git archive); after: this checkout",
         "- wall: seconds; CPU: process CPU seconds, all threads (robust to a busy machine, wall is not)",
         "- after: the two traces run in a child process (`mbert.export.background`) beside the stages that follow "
         "them; their rows, marked (background), overlap the other rows and are not part of their sum; the total "
         "is end-to-end wall time, and its CPU time includes the children's",
         f"- command: `python benchmarks/export_time.py {' '.join(sys.argv[1:])}`", ""]
    for system in [s for s in SYSTEMS if s in res]:
        r = res[system]
        L += [f"## {system}", ""]
        if r["status"] != "ok":
            L += [f"{r['status']}: {r['reason']}", ""]
            continue
        child_rss = f", its largest child process {r['child_peak_rss_gib']:.2f} GiB" if r.get("child_peak_rss_gib") else ""
        L += [f"peak RSS {r['peak_rss_gib']:.2f} GiB{child_rss}; package {r['package']}", "",
              "| stage | wall (s) | CPU (s) |", "|---|---:|---:|"]
        L += [f"| {s['stage']} | {s['wall_s']:.1f} | {s['cpu_s']:.1f} |" for s in r["stages"]]
        L.append("")
    after = res.get("after", {})
    if after.get("status") == "ok" and not args.quick:
        stages = {s["stage"]: s["wall_s"] for s in after["stages"]}
        L += ["## Targets (wall time; meaningful on an idle machine only)", "", "| what | target | measured | |",
              "|---|---|---:|---|"]
        for what, bound, value in (("end to end", TARGET_TOTAL_S, stages.get("total")),
                                   ("scan", TARGET_SCAN_S, stages.get("scan"))):
            verdict = "n/a" if value is None else ("met" if value <= bound else "MISSED")
            L.append(f"| {what} | <= {bound:.0f} s | {'n/a' if value is None else f'{value:.1f} s'} | {verdict} |")
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    ap.add_argument("--before", default=BEFORE_REV, help="git revision for the 'before' pipeline")
    ap.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"), help="--device of 'after'")
    ap.add_argument("--quick", action="store_true", help=f"smoke test: the tests' 2-layer TINY model, max_seq_len {QUICK_MAX_LEN}")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--cache", type=Path, default=REPO / "benchmarks" / ".cache")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per system")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cache = args.cache.resolve()
    if args.child:
        return child(args.child, args)
    systems = args.systems.split(",")
    if set(systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(set(systems) - set(SYSTEMS))}")
    args.load = os.getloadavg()[0]
    checkpoint(args.cache, args.quick)  # built once, outside the timed children
    res = {}
    for system in systems:
        print(f"{system} ...", flush=True)
        res[system] = run_child(system, args)
        print(json.dumps(res[system])[:400], flush=True)
    lines = report(args, res)
    stem = "export_time_quick" if args.quick else "export_time" if systems == list(SYSTEMS) else "export_time_custom"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    print("\n" + "\n".join(lines))
    print(f"\nwrote {args.out / (stem + '.md')} and .json")


if __name__ == "__main__":
    main()
