#!/usr/bin/env python
"""ModernBERT-base on CPU: this project's ONNX forms against transformers' ONNX, sdpa and eager.

One seeded random full-size ModernBERT-base checkpoint (22 layers, built with the test helper),
these systems side by side (one trace of ``load_model(folder)`` with ``max_seq_len=8192``):

  ours-ort     target "onnxruntime": fused MultiHeadAttention in global layers (the ORT artifact)
  ours-trt     target "tensorrt": standard ONNX ops, all heads at once (the TensorRT artifact) on ORT
  ours-before  the baseline graph (revision b06b5a7): standard ops, global layers one head at a time (rebuilt
               here with a benchmark-only lowering of the same attention op, for "no slower than today")
  hf-onnx      transformers' AutoModel (eager attention) through torch.onnx.export, as a user would:
               dynamo=True with dynamic batch/sequence first, dynamo=False + dynamic_axes if that fails;
               run with ONNX Runtime's default session options, as a user would
  hf-onnx-same the same graph with this project's session options (``mbert.runtime.backends.session_options``:
               memory-pattern planning off), so that the session options are not what the ratio measures
  hf-sdpa      transformers in PyTorch, attn_implementation="sdpa" (hf-eager: "eager", run only when asked for)

Sessions: ours-ort and ours-trt run with the project's session options (what the runtime and the
export's validation open), ours-before and hf-onnx with ONNX Runtime's defaults (what the baseline
revision ran, and what a user of transformers' export runs), hf-onnx-same with the project's.

Every (system, shape) runs in a fresh subprocess that loads only what that system needs, so peak
RSS (ru_maxrss) is per system and shape; the increase over the RSS after loading is reported too.
Quadratic-memory systems are skipped when their estimated footprint exceeds MemAvailable; an OOM-killed
child is reported as such. Checkpoint and ONNX files are cached in benchmarks/.cache/ (git-ignored).

    python benchmarks/onnx_cpu.py                      # full run: 4x512, 1x2048, 1x8192
    python benchmarks/onnx_cpu.py --quick --out /tmp/x # smoke test: 2x128, 1x512, one timed run
    python benchmarks/onnx_cpu.py --quick --small --systems ours-ort,ours-trt --out /tmp/x
                                                       # the tests' smoke form: 2-layer TINY model; hf-onnx
                                                       # (transformers' own export, slow) is left to full runs
    python benchmarks/ort_profile.py 1x8192            # ORT's profiler on ours-ort (after a run built the cache)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("ours-ort", "ours-trt", "ours-before", "hf-onnx", "hf-onnx-same", "hf-sdpa", "hf-eager")
DEFAULT_SYSTEMS = SYSTEMS[:-1]
OURS = ("ours-ort", "ours-trt", "ours-before")  # the graphs one export writes (ours-ort is "ours")
ORT_SYSTEMS = OURS + ("hf-onnx", "hf-onnx-same")
PROJECT_OPTIONS = ("ours-ort", "ours-trt", "hf-onnx-same")  # run with mbert.runtime.backends.session_options
LABELS = {"ours-ort": "mbert ONNX, ORT form (fused attention)", "ours-trt": "mbert ONNX, TensorRT form (on ORT)",
          "ours-before": "mbert ONNX baseline (per head)", "hf-onnx": "transformers ONNX (ORT, default options)",
          "hf-onnx-same": "transformers ONNX (ORT, our options)",
          "hf-eager": "transformers eager (torch)", "hf-sdpa": "transformers sdpa (torch)"}
FULL_SHAPES, QUICK_SHAPES = "4x512,1x2048,1x8192", "2x128,1x512"
# (shape, description, kind, other system, bound): speed = other latency / ours latency >= bound,
# rss = ours peak RSS / other peak RSS <= bound.
TARGETS = [  # the attention and export-speed targets
    ("1x8192", "ours vs transformers-ONNX speed", "speed", "hf-onnx", 3.0),
    ("1x8192", "ours / transformers-ONNX peak RSS", "rss", "hf-onnx", 0.125),
    ("1x8192", "ours vs transformers-ONNX speed, same session options", "speed", "hf-onnx-same", 3.0),
    ("1x8192", "ours / transformers-ONNX peak RSS, same session options", "rss", "hf-onnx-same", 0.125),
    ("4x512", "ours vs the per-head baseline (no slower)", "speed", "ours-before", 1.0),
    ("1x2048", "ours vs the per-head baseline (no slower)", "speed", "ours-before", 1.0),
]
# Live [B, H, T, T] fp32 score-sized tensors at peak: transformers' ONNX measured 17 GB at 1 x 8192
# (~5 copies + weights), eager ~4 copies; the TensorRT form on ORT keeps ~3 (MatMul, Add, Softmax).
# The others are linear in T (fused, or one head at a time): no guard.
SCORE_COPIES = {"hf-onnx": 5, "hf-onnx-same": 5, "hf-eager": 4, "ours-trt": 3}


def paths(cache: Path) -> dict[str, Path]:
    ours = cache / "onnx-ours-v2"
    return {"ckpt": cache / "modernbert-base-random", "ours-ort": ours / "model.ort.onnx",
            "ours-trt": ours / "model.trt.onnx", "ours-before": ours / "model.before.onnx",
            "ours": ours / "model.ort.onnx", "hf-onnx": cache / "onnx-hf" / "model.onnx",
            "hf-onnx-same": cache / "onnx-hf" / "model.onnx"}


def proc_kb(file: str, key: str) -> int | None:
    for line in Path(file).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def estimate_gib(system: str, B: int, T: int, cfg: dict, weights_bytes: int) -> float | None:
    if system not in SCORE_COPIES:
        return None
    scores = B * cfg["num_attention_heads"] * T * T * 4
    return (2 * weights_bytes + SCORE_COPIES[system] * scores) / 2**30


def session_options_for(system: str, threads: int):
    """The session options ``system`` runs with (module docstring, "Sessions"), inter-op 1."""
    import onnxruntime as ort

    if system in PROJECT_OPTIONS:
        from mbert.runtime.backends.onnxruntime import session_options

        so = session_options(threads)
    else:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return so


def child(system: str, B: int, T: int, repeats: int, threads: int, seed: int, cache: Path) -> None:
    """Load one system, warm up once, time ``repeats`` runs, print one JSON line."""
    import numpy as np

    p = paths(cache)
    cfg = json.loads((p["ckpt"] / "config.json").read_text())
    ids = np.random.default_rng(seed).integers(0, cfg["vocab_size"], (B, T), dtype=np.int64)
    mask = np.ones_like(ids)
    torch_threads = None
    if system in ORT_SYSTEMS:
        import onnxruntime as ort

        sess = ort.InferenceSession(str(p[system]), session_options_for(system, threads), providers=["CPUExecutionProvider"])
        feeds = dict(zip([i.name for i in sess.get_inputs()], (ids, mask)))

        def run():
            return sess.run(None, feeds)[0]
    else:
        import torch
        import transformers

        torch.set_num_threads(threads)
        torch_threads = torch.get_num_threads()
        model = transformers.AutoModel.from_pretrained(p["ckpt"], attn_implementation=system[3:]).eval()
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)

        def run():
            with torch.inference_mode():
                return model(input_ids=t_ids, attention_mask=t_mask).last_hidden_state.numpy()
    loaded_kb = proc_kb("/proc/self/status", "VmRSS")
    try:  # reset VmHWM so that the run's own peak is measured, not the loading spike
        Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    out, times = run(), []  # one warm-up run
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    run_peak_kb = proc_kb("/proc/self/status", "VmHWM") if hwm_reset else peak_kb
    print(json.dumps({
        "status": "ok", "latency_s": statistics.median(times), "times_s": times,
        "tokens_per_s": B * T / statistics.median(times), "peak_rss_gib": peak_kb / 2**20,
        "loaded_rss_gib": loaded_kb / 2**20, "increase_gib": max(run_peak_kb - loaded_kb, 0) / 2**20,
        "ort_threads": threads if torch_threads is None else None, "torch_threads": torch_threads,
        "sample": [float(x) for x in np.concatenate([out[0, 0, :8], out[-1, -1, :8]])],
    }))



def export_child(what: str, cache: Path, small: bool) -> None:
    """Build the checkpoint or one system's ONNX files into the cache (run in a subprocess)."""
    p = paths(cache)
    if what == "checkpoint":
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import TINY, make_checkpoint

        make_checkpoint(p["ckpt"], "modernbert-base", seed=0, **(TINY if small else {}))
        return
    p[what].parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if what == "ours":
        from mbert.export.onnx.trace import export_targets
        from mbert.modeling import load_model

        model = load_model(p["ckpt"])
        export_targets(model, {"onnxruntime": p["ours-ort"], "tensorrt": p["ours-trt"]}, max_seq_len=8192)
        export_before(model, p["ours-before"])
        meta = {"method": "mbert.export.onnx.trace.export_targets (dynamo), one trace for both targets; "
                          "ours-before: the same trace with the per-head lowering of this script"}
    else:
        meta = export_hf(p["ckpt"], p["hf-onnx"])
    meta["export_s"] = round(time.perf_counter() - t0, 1)
    (p[what].parent / "export.json").write_text(json.dumps(meta, indent=2))


def per_head_attention(q, k, v, bias):
    """The attention of the baseline graph (revision b06b5a7): global layers one head at a time (standard ops)."""
    from onnxscript import opset18 as op

    from mbert.export.onnx.lowering import standard_attention

    if len(q.shape) != 4 or bias.shape[2] != 1:
        return standard_attention(q, k, v, bias)
    heads = []
    for h in range(q.shape[1]):
        q1, k1, v1 = (op.Slice(x, op.Constant(value_ints=[h]), op.Constant(value_ints=[h + 1]),
                               op.Constant(value_ints=[1])) for x in (q, k, v))
        scores = op.MatMul(q1, op.Transpose(k1, perm=[0, 1, 3, 2]))
        probs = op.Softmax(op.Add(op.Cast(scores, to=1), bias), axis=-1)
        heads.append(op.MatMul(op.CastLike(probs, v1), v1))
    return op.Concat(*heads, axis=1)


def export_before(model, path: Path) -> None:
    import torch

    from mbert.export.onnx.trace import check_graph
    from mbert.modeling.graph import GraphModule

    graph = GraphModule(model, None).eval()
    ids = torch.zeros((2, 131), dtype=torch.int64)
    seq = torch.export.Dim("sequence", min=1, max=8192)
    dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: seq}
    program = torch.onnx.export(graph, (ids, torch.ones_like(ids)), None, dynamo=True,
                                input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                                dynamic_shapes={"input_ids": dims, "attention_mask": dims}, opset_version=18,
                                custom_translation_table={torch.ops.mbert.attention.default: per_head_attention})
    program.save(str(path))
    check_graph(path)


def export_hf(folder: Path, path: Path) -> dict:
    """torch.onnx.export of transformers' model the way a user would, checked on ORT at new shapes."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.ones_like(ids))
    io = {"input_names": ["input_ids", "attention_mask"], "output_names": ["last_hidden_state"]}
    meta: dict = {"errors": {}}
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    attempts = {
        "dynamo=True, dynamic_shapes": dict(dynamo=True, dynamic_shapes={
            "input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}),
        "dynamo=False, dynamic_axes": dict(dynamo=False, opset_version=17, dynamic_axes={
            n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "last_hidden_state")}),
    }
    for name, kwargs in attempts.items():
        try:
            path.unlink(missing_ok=True)
            torch.onnx.export(model, args, str(path), **io, **kwargs)
            meta["check_max_rel_diff"] = check_hf_onnx(model, path, vocab)
            meta["method"] = name
            return meta
        except Exception as exc:  # any exporter or check failure: record it, try the next way
            meta["errors"][name] = f"{type(exc).__name__}: {(str(exc).strip() or '?').splitlines()[0][:300]}"
            print(f"[hf-onnx export] {name} failed: {meta['errors'][name]}", file=sys.stderr)
    raise SystemExit(f"every export of transformers' model failed: {json.dumps(meta['errors'])}")


def check_hf_onnx(model, path: Path, vocab: int) -> float:
    """The graph runs at batch 1 and 3 and other lengths than traced, and matches PyTorch."""
    import numpy as np
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for B, T in ((1, 300), (3, 130)):
        ids = np.random.default_rng(1).integers(0, vocab, (B, T), dtype=np.int64)
        got = sess.run(None, dict(zip([i.name for i in sess.get_inputs()], (ids, np.ones_like(ids)))))[0]
        with torch.inference_mode():
            t_ids = torch.from_numpy(ids)
            ref = model(input_ids=t_ids, attention_mask=torch.ones_like(t_ids)).last_hidden_state.numpy()
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        if got.shape != ref.shape or not rel < 1e-3:
            raise RuntimeError(f"exported graph disagrees with PyTorch at {B}x{T}: max rel diff {rel:.2e}")
        worst = max(worst, rel)
    return worst


def prepare(args, systems: list[str]) -> dict:
    p = paths(args.cache)
    if args.fresh:
        for key in ("ckpt", "ours", "hf-onnx"):
            shutil.rmtree(p[key] if key == "ckpt" else p[key].parent, ignore_errors=True)
    # the last file each build writes marks it finished (make_checkpoint copies the tokenizer files last)
    todo = [("checkpoint", p["ckpt"] / "special_tokens_map.json")]
    todo += [(s, p[s].parent / "export.json") for s in ("ours", "hf-onnx")
             if s in systems or (s == "ours" and set(OURS) & set(systems))
             or (s == "hf-onnx" and "hf-onnx-same" in systems)]
    meta = {}
    for what, target in todo:
        if not target.exists():
            print(f"building {what} -> {target} ...", flush=True)
            cmd = [sys.executable, __file__, "--export", what, "--cache", str(args.cache)] + (["--small"] if args.small else [])
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                meta[what] = {"error": f"building {what} failed (exit {rc}); see the log above"}
                continue
        if what != "checkpoint":
            meta[what] = json.loads(target.read_text())
    if "error" in meta.get("checkpoint", {}):
        raise SystemExit(meta["checkpoint"]["error"])
    return meta


def run_one(args, system: str, B: int, T: int, repeats: int, cfg: dict, meta: dict) -> dict:
    built = "ours" if system in OURS else "hf-onnx" if system == "hf-onnx-same" else system
    if "error" in meta.get(built, {}):
        return {"status": "failed", "reason": meta[built]["error"]}
    need = estimate_gib(system, B, T, cfg, args.weights_bytes)
    faked = args.mem_limit_gb is not None
    avail = args.mem_limit_gb if faked else proc_kb("/proc/meminfo", "MemAvailable") / 2**20
    if need is not None and need > avail:
        src = "--mem-limit-gb" if faked else "MemAvailable"
        return {"status": "skipped", "reason": f"needs ~{need:.1f} GiB (estimate), {avail:.1f} GiB available ({src})"}
    cmd = [sys.executable, __file__, "--child", system, str(B), str(T), "--repeats", str(repeats),
           "--threads", str(args.threads), "--seed", str(args.seed), "--cache", str(args.cache)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"no result within --timeout {args.timeout} s"}
    if proc.returncode == -signal.SIGKILL:  # a timeout also kills, but raises TimeoutExpired first
        return {"status": "oom", "reason": "killed by SIGKILL: the OOM killer (out of memory)"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"exit {proc.returncode}: {err[:300]}"}
    return json.loads(lines[-1])


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("mbert-export", "torch", "transformers", "onnxruntime", "onnx", "onnxscript", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{cpu}, {os.cpu_count()} logical CPUs, {proc_kb('/proc/meminfo', 'MemTotal') / 2**20:.1f} GiB RAM"


def ratio(res: dict, shape: str, kind: str, other: str, ours: str = "ours-ort") -> float | None:
    a, b = res.get((ours, shape), {}), res.get((other, shape), {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return b["latency_s"] / a["latency_s"] if kind == "speed" else a["peak_rss_gib"] / b["peak_rss_gib"]


def report(args, shapes, systems, res: dict, meta: dict) -> list[str]:
    ok = [r for r in res.values() if r.get("status") == "ok"]
    ort_threads = next((r["ort_threads"] for r in ok if r.get("ort_threads")), "-")
    torch_threads = next((r["torch_threads"] for r in ok if r.get("torch_threads")), "-")
    hf = meta.get("hf-onnx", {})
    hf_line = hf.get("error") or f"{hf.get('method', '-')}" + (
        f" (failed first: {'; '.join(f'{k}: {v}' for k, v in hf['errors'].items())})" if hf.get("errors") else "")
    model = ("SMOKE TEST, the tests' 2-layer TINY random model (--small): not a result" if args.small
             else "ModernBERT-base (random weights, 22 layers)")
    L = [f"# ONNX on CPU: {model}\n",
         f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
         f"- machine: {machine()}",
         f"- versions: {', '.join(f'{k} {v}' for k, v in versions().items())}",
         f"- threads: ORT intra-op = {ort_threads} (inter-op 1), torch.get_num_threads() = {torch_threads}",
         f"- transformers' ONNX export: {hf_line if {'hf-onnx', 'hf-onnx-same'} & set(systems) else 'not built'}",
         f"- timing: one warm-up run, then the median of N timed runs; inputs: random ids (seed {args.seed}), "
         "full attention mask",
         "- peak RSS: ru_maxrss of a fresh process per system and shape; increase: peak during the runs "
         "over the RSS after loading the model/session",
         f"- command: `python benchmarks/onnx_cpu.py {' '.join(sys.argv[1:])}`", "",
         "| shape | system | latency (s) | tokens/s | peak RSS (GiB) | increase (GiB) | N | max abs diff vs ours-ort |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]
    for shape in shapes:
        ref = res.get(("ours-ort", shape), {}).get("sample")
        for s in systems:
            r = res[(s, shape)]
            if r["status"] != "ok":
                L.append(f"| {shape} | {LABELS[s]} | {r['status']}: {r['reason']} | | | | | |")
                continue
            diff = "-" if not ref or s == "ours-ort" else f"{max(abs(x - y) for x, y in zip(r['sample'], ref)):.1e}"
            L.append(f"| {shape} | {LABELS[s]} | {r['latency_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_rss_gib']:.2f} | {r['increase_gib']:.2f} | {len(r['times_s'])} | {diff} |")
    L += ["", "## Ratios (ours = the ORT form, against each)", "",
          "| shape | other | speed-up (other latency / ours) | peak RSS (ours / other) |", "|---|---|---:|---:|"]
    for shape in shapes:
        for s in [s for s in systems if s != "ours-ort"] if "ours-ort" in systems else []:
            sp, rs = ratio(res, shape, "speed", s), ratio(res, shape, "rss", s)
            L.append(f"| {shape} | {LABELS[s]} | {'n/a' if sp is None else f'{sp:.2f}x'} | "
                     f"{'n/a' if rs is None else f'{rs:.2f}'} |")
    L += ["", "## Targets", "", "| shape | ratio | target | measured | |", "|---|---|---|---:|---|"]
    for shape, desc, kind, other, bound in TARGETS:
        v = ratio(res, shape, kind, other)
        if v is None:
            shown, verdict = "n/a", f"n/a ({'shape not run' if shape not in shapes else 'a system did not run'})"
        else:
            shown = f"{v:.2f}x" if kind == "speed" else f"{v:.3f}"
            verdict = "met" if (v >= bound if kind == "speed" else v <= bound) else "MISSED"
        L.append(f"| {shape} | {desc} | {'>=' if kind == 'speed' else '<='} {bound} | {shown} | {verdict} |")
    return L


def plot(shapes, systems, res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(systems)
    panels = ((axes[0], "latency_s", "latency (s, log scale)"), (axes[1], "peak_rss_gib", "peak RSS (GiB)"))
    for ax, key, title in panels:
        for i, s in enumerate(systems):
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(shapes))]
            rows = [res[(s, sh)] for sh in shapes]
            vals = [r[key] if r["status"] == "ok" else 0 for r in rows]
            ax.bar(xs, vals, width, label=LABELS[s])
            for x, r in zip(xs, rows):  # mark skipped/failed runs where their bar would be
                if r["status"] != "ok":
                    ax.text(x, 0.02, r["status"], transform=ax.get_xaxis_transform(), ha="center",
                            va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(range(len(shapes)), [sh.replace("x", " x ") for sh in shapes])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(systems), fontsize=9)
    fig.suptitle("ModernBERT-base on CPU: mbert ONNX forms vs transformers")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help=f"BxT list (default {FULL_SHAPES})")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    ap.add_argument("--repeats", type=int, help="timed runs after the warm-up (default 3 for T <= 2048, 1 above)")
    ap.add_argument("--quick", action="store_true", help=f"smoke test: shapes {QUICK_SHAPES}, repeats 1")
    ap.add_argument("--small", action="store_true",
                    help="smoke test of the script itself: the tests' 2-layer TINY random model (own cache; no results)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--cache", type=Path, default=REPO / "benchmarks" / ".cache")
    ap.add_argument("--fresh", action="store_true", help="rebuild the cached checkpoint and ONNX files")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads and torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per (system, shape) child")
    ap.add_argument("--mem-limit-gb", type=float, help="pretend only this many GiB are free (tests the skip path)")
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "B", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--export", choices=("checkpoint", "ours", "hf-onnx"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cache = (args.cache / "tiny" if args.small and not (args.child or args.export) else args.cache).resolve()
    if args.child:
        system, B, T = args.child
        return child(system, int(B), int(T), args.repeats, args.threads, args.seed, args.cache)
    if args.export:
        return export_child(args.export, args.cache, args.small)

    shapes, systems = (args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES)).split(","), args.systems.split(",")
    args.repeats = 1 if args.quick and args.repeats is None else args.repeats
    if set(systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(set(systems) - set(SYSTEMS))}; choose from {', '.join(SYSTEMS)}")
    meta = prepare(args, systems)
    p = paths(args.cache)
    cfg = json.loads((p["ckpt"] / "config.json").read_text())
    args.weights_bytes = sum(f.stat().st_size for f in p["ckpt"].glob("*.safetensors"))
    res = {}
    for shape in shapes:
        B, T = map(int, shape.split("x"))
        repeats = args.repeats or (3 if T <= 2048 else 1)
        for s in systems:
            print(f"{shape:>7} {s:<9} ...", end=" ", flush=True)
            r = res[(s, shape)] = run_one(args, s, B, T, repeats, cfg, meta)
            print(f"{r['latency_s']:.3f} s, peak RSS {r['peak_rss_gib']:.2f} GiB" if r["status"] == "ok"
                  else f"{r['status']}: {r['reason']}", flush=True)
    lines = report(args, shapes, systems, res, meta)
    default_run = shapes == FULL_SHAPES.split(",") and set(systems) >= set(DEFAULT_SYSTEMS)
    stem = "onnx_cpu" if default_run and not args.small else "onnx_cpu_quick" if args.quick else "onnx_cpu_custom"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(shapes, systems, res, args.out / f"{stem}.png")
    lines += ["", f"![latency and peak RSS per shape]({stem}.png)"]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "results": [{"system": s, "shape": sh, **r} for (s, sh), r in res.items()]}, indent=1))
    print("\n" + "\n".join(lines))
    print(f"\nwrote {args.out / (stem + '.md')}, .png and .json")


if __name__ == "__main__":
    main()
