#!/usr/bin/env python
"""ONNX Runtime's profiler on one of the graphs ``benchmarks/onnx_cpu.py`` built: time per op type.

    python benchmarks/onnx_cpu.py --shapes 4x512 --systems ours-ort   # builds the cache once
    python benchmarks/ort_profile.py 1x8192                          # ours-ort at 1 x 8192
    python benchmarks/ort_profile.py 1x2048 --system hf-onnx

The session is opened as ``onnx_cpu.py`` opens it for that system (``PROJECT_OPTIONS``); the table
sums the profiler's Node events per op type over the runs (warm-up included) and divides by them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from onnx_cpu import ORT_SYSTEMS, REPO, paths, session_options_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", default="1x2048", help="BxT (default 1x2048)")
    ap.add_argument("--system", default="ours-ort", choices=ORT_SYSTEMS)
    ap.add_argument("--repeats", type=int, default=1, help="runs after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=REPO / "benchmarks" / ".cache")
    args = ap.parse_args()

    import numpy as np
    import onnxruntime as ort

    B, T = map(int, args.shape.split("x"))
    p = paths(args.cache)
    if not p[args.system].exists():
        raise SystemExit(f"{p[args.system]} does not exist: run benchmarks/onnx_cpu.py once to build it")
    cfg = json.loads((p["ckpt"] / "config.json").read_text())
    so = session_options_for(args.system, args.threads)
    so.enable_profiling = True
    so.profile_file_prefix = str(args.cache / f"ort_profile_{args.system}_{args.shape}")
    sess = ort.InferenceSession(str(p[args.system]), so, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(args.seed).integers(0, cfg["vocab_size"], (B, T), dtype=np.int64)
    feeds = dict(zip([i.name for i in sess.get_inputs()], (ids, np.ones_like(ids))))
    runs = 1 + args.repeats
    for _ in range(runs):
        sess.run(None, feeds)
    trace = Path(sess.end_profiling())
    totals: dict[str, int] = {}
    for ev in json.loads(trace.read_text()):
        if ev.get("cat") == "Node" and "op_name" in ev.get("args", {}):
            totals[ev["args"]["op_name"]] = totals.get(ev["args"]["op_name"], 0) + ev.get("dur", 0)
    total = sum(totals.values()) or 1
    print(f"ORT profile of {args.system} at {args.shape}, {runs} runs (incl. warm-up), {args.threads} threads; "
          f"trace: {trace}")
    print(f"{'op type':<28}{'ms/run':>10}{'share':>8}")
    for op, dur in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{op:<28}{dur / 1e3 / runs:>10.1f}{100 * dur / total:>7.1f}%")
    print(f"{'all nodes':<28}{total / 1e3 / runs:>10.1f}")


if __name__ == "__main__":
    main()
