#!/usr/bin/env python
"""What a serving install costs: the ``[cpu,serve]`` venv on disk, ``mbert-run embed`` of one sentence
(wall time, peak RSS), one Triton Python-model instance's resident memory and tritonserver's time to
ready, runtime throughput; each side by side for two installs of this project in fresh venvs.

  before   a venv with ``pip install 'torch==2.13.0' 'REV[cpu,serve]'`` of revision ``--before-rev``
           (a ``git worktree``; torch named so pip takes the CPU wheel, as that revision's README said)
  after    a venv with ``pip install '.[cpu,serve]'`` of this checkout (tracked and untracked files as
           they are): no torch may be installed (checked with ``pip list``)

Each side embeds and serves a tiny bundle (3 layers, hidden 128; --quick: 2, at 128 tokens) that its own exporter wrote
(``after``: the exporter of this checkout in the running Python, which has the ``export`` extra, so
the serving venv runs a bundle exported elsewhere); the ``after`` side's vectors from ``embed`` and
``serve`` are compared with the running Python's (the full install's) on the same bundle.

  embed      ``mbert-run embed BUNDLE "It's time for tea." --output F.npy``, a fresh process each time:
             median wall of --repeats runs and the largest peak RSS (``wait4``'s ru_maxrss)
  serve      ``mbert-run serve BUNDLE`` on free loopback ports: seconds from the command's start and
             from tritonserver's own start (``/proc/PID/stat``) to the banner it prints once ready;
             then one request, and each Python-backend stub's VmRSS (one per model instance)
  runtime    ``Encoder.from_bundle(bundle, backend="onnxruntime").encode(corpus)`` in the venv on
             40 texts up to 512 tokens (``runtime_cpu.build_corpus``): median of 3 after a warm-up

    python benchmarks/serving_footprint.py             # builds /tmp/mbert-footprint/{before,after}
                                                       # -> results/serving_footprint.md
    python benchmarks/serving_footprint.py --quick --out /tmp/x   # smoke test: the running Python as
                                                       # "after" only, no venvs, the tests' 2-layer TINY at
                                                       # 128 tokens, runtime_cpu.py's --quick corpus,
                                                       # 1 embed run -> serving_footprint_quick.md

Targets: the ``[cpu,serve]`` venv <= 1 GB; embed of one sentence <= 1.0 s wall and <= 200 MB peak RSS
on the tiny bundle; no regression in runtime throughput. Timings mean little on a shared machine:
the report records the load average at the start.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from runtime_cpu import QUICK as QUICK_CORPUS  # noqa: E402
from runtime_cpu import build_corpus, log  # noqa: E402

from mbert.bundle.names import TOKENIZER  # noqa: E402

SENTENCE = "It's time for tea."
TINY = dict(num_hidden_layers=3, hidden_size=128, num_attention_heads=2, intermediate_size=192, local_attention=16)
MAX_LEN = 512  # the bundles' max_seq_len (--quick: QUICK_CORPUS's)
CORPUS = dict(max_len=MAX_LEN, buckets=[("query", 16, 6, 30), ("passage", 16, 60, 300), ("document", 8, 300, 512)])
TARGETS = {"venv_mb": 1000, "embed_wall_s": 1.0, "embed_rss_mb": 200}
THROUGHPUT = """
import json, sys, time, statistics, warnings
from mbert.runtime import Encoder
corpus = json.load(open(sys.argv[2]))
enc = Encoder.from_bundle(sys.argv[1], backend="onnxruntime", device="cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    enc.encode(corpus[:8])
    times = []
    for _ in range(3):
        t0 = time.perf_counter(); enc.encode(corpus); times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": statistics.median(times)}))
"""


# --- the installs ------------------------------------------------------------------------------------

def make_venv(venv: Path, requirements: list[str]) -> None:
    """``python -m venv`` and one ``pip install``."""
    log(f"building {venv}: pip install {' '.join(requirements)}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *requirements], check=True)


def checkout_copy(dest: Path) -> Path:
    """This checkout's tracked and untracked (not ignored) files, as they are, copied to ``dest``."""
    if dest.exists():
        return dest
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout
    dest.mkdir(parents=True)
    packed = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=REPO, input=names, check=True,
                            capture_output=True).stdout
    subprocess.run(["tar", "-xf", "-", "-C", str(dest)], input=packed, check=True)
    return dest


def worktree(rev: str, dest: Path) -> Path:
    if not dest.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(dest), rev], cwd=REPO, check=True,
                       capture_output=True)
    return dest


def size_mb(folder: Path) -> float:
    """Bytes on disk (allocated blocks) of every file under ``folder``, in MB (10^6)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total / 1e6


def largest(venv: Path, count: int = 6) -> list[tuple[str, float]]:
    """The ``count`` largest entries of the venv's site-packages, (name, MB)."""
    site = next(venv.glob("lib/python*/site-packages"))
    sizes = [(p.name, size_mb(p) if p.is_dir() else p.stat().st_size / 1e6) for p in site.iterdir()]
    return sorted(sizes, key=lambda kv: -kv[1])[:count]


def packages(python: Path) -> dict[str, str]:
    done = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                          check=True)
    return {p["name"].lower(): p["version"] for p in json.loads(done.stdout)}


# --- the measurements ----------------------------------------------------------------------------------

def tiny_checkpoint(cache: Path, quick: bool) -> Path:
    """TINY's checkpoint; with ``quick`` the tests' 2-layer ``helpers.TINY`` (the smoke form's trace is half)."""
    import helpers

    ck = cache / ("checkpoint-quick" if quick else "checkpoint-tiny")
    if not (ck / "special_tokens_map.json").is_file():  # written last by make_checkpoint
        helpers.make_checkpoint(ck, base="gte-modernbert-base", layout="cls-pooling", seed=0,
                                **(helpers.TINY if quick else TINY))
    return ck


def export(exporter: list[str], ck: Path, out: Path, max_len: int) -> Path:
    if not (out / "manifest.json").is_file():
        log(f"exporting {out} with {exporter[0]}")
        subprocess.run([*exporter, str(ck), "--out", str(out), "--max-seq-len", str(max_len), "--overwrite"],
                       check=True, capture_output=True)
    return out


def timed(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, peak RSS in MB, the finished process) of ``command``, measured by GNU time: a
    process forked from this one (which may hold torch) would count this one's pages in its peak."""
    with tempfile.NamedTemporaryFile(suffix=".time") as measured:
        done = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", measured.name, *command], capture_output=True)
        wall, peak_kb = Path(measured.name).read_text().split()[-2:]
    return float(wall), int(peak_kb) / 1024, done


def embed(run: Path, bundle: Path, work: Path, repeats: int) -> dict:
    walls, peaks = [], []
    out = work / "embed.npy"
    for _ in range(repeats):
        wall, peak, done = timed([str(run), "embed", str(bundle), SENTENCE, "--output", str(out)])
        if done.returncode != 0:
            raise RuntimeError(f"{run} embed failed: {done.stderr.decode()[-2000:]}")
        walls.append(wall)
        peaks.append(peak)
    import numpy as np

    return {"wall_s": statistics.median(walls), "walls": walls, "rss_mb": max(peaks), "vector": np.load(out)}


def info_works(run: Path, bundle: Path) -> bool:
    return subprocess.run([str(run), "info", str(bundle)], capture_output=True, timeout=120).returncode == 0


def _start_time(pid: int) -> float:
    """A process's start, on the ``time.time()`` clock (``/proc/PID/stat`` field 22, since boot)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def serve(run: Path, bundle: Path, timeout_s: float = 300) -> dict:
    """``mbert-run serve``: time to ready, one request, each Python model instance's RSS."""
    import numpy as np

    command = [str(run), "serve", str(bundle), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("Ctrl-C stops it.")):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
        ready = time.time()
        if not (lines and lines[-1].startswith("Ctrl-C stops it.")):
            raise RuntimeError(f"{run} serve did not get ready: {''.join(lines)[-2000:]}")
        http = next(x.split()[-1] for x in lines if x.strip().startswith("HTTP"))
        model = sorted(m.strip(",") for x in lines if x.strip().startswith("models") for m in x.split()[1:])[0]
        servers = [p for p in _children(proc.pid) if "tritonserver" in Path(f"/proc/{p}/cmdline").read_text()]
        server_start = _start_time(servers[0])
        body = json.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [SENTENCE]}],
                           "outputs": [{"name": "sentence_embedding"}]}).encode()
        import urllib.request

        request = urllib.request.Request(f"{http}/v2/models/{model}/infer", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        vector = np.array(answer["outputs"][0]["data"], dtype=np.float32).reshape(1, -1)
        stubs, torch_mapped = {}, False
        for pid in _children(servers[0]):
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if argv and argv[0].endswith("triton_python_backend_stub"):  # argv[1]: MODEL/1/model.py
                stubs[Path(argv[1]).parent.parent.name] = _rss_mb(pid)
                torch_mapped |= "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"command_to_ready_s": ready - started, "server_to_ready_s": ready - server_start, "stubs": stubs,
            "vector": vector, "torch_in_stubs": torch_mapped}


def throughput(python: Path, bundle: Path, corpus_file: Path) -> float:
    done = subprocess.run([str(python), "-c", THROUGHPUT, str(bundle), str(corpus_file)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def has_tritonserver() -> bool:
    from mbert.runtime.serve.server import ServeError, find_tritonserver

    try:
        find_tritonserver()
    except ServeError:
        return False
    return True


def measure(name: str, python: Path, bundle: Path, work: Path, corpus_file: Path, repeats: int,
            venv: Path | None) -> dict:
    run = python.parent / "mbert-run"
    log(f"{name}: embed x{repeats}")
    side: dict = {"python": str(python), "bundle": str(bundle)}
    if venv is not None:
        pkgs = packages(python)
        side.update(venv_mb=size_mb(venv), packages=len(pkgs), torch=pkgs.get("torch"), largest=largest(venv),
                    heavy=sorted(p for p in ("torch", "onnx", "onnxscript", "matplotlib") if p in pkgs),
                    imports_torch=subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0)
    side["embed"] = embed(run, bundle, work, repeats)
    side["info_ok"] = info_works(run, bundle)
    if has_tritonserver():
        log(f"{name}: serve")
        side["serve"] = serve(run, bundle)
    log(f"{name}: runtime throughput")
    side["throughput_s"] = throughput(python, bundle, corpus_file)
    return side


# --- the report ------------------------------------------------------------------------------------------

def _cos(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64).reshape(1, -1), np.asarray(b, np.float64).reshape(1, -1)
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def report(args, sides: dict, full: dict, corpus_tokens: int, texts: int) -> str:
    names = list(sides)
    head = "| | " + " | ".join(names) + (" | after / before |" if len(names) == 2 else " |")
    rule = "|---|" + "---|" * (len(names) + (1 if len(names) == 2 else 0))

    def row(label, values, fmt, ratio=True):
        cells = [fmt(v) if v is not None else "-" for v in values]
        extra = ""
        if len(values) == 2:
            extra = f" {values[1] / values[0]:.2f}x |" if ratio and None not in values and values[0] else " - |"
        return f"| {label} | " + " | ".join(cells) + " |" + extra

    get = lambda key, sub=None: [(s.get(key) if sub is None else (s.get(key) or {}).get(sub)) for s in sides.values()]  # noqa: E731
    lines = [f"# Serving footprint{' (--quick)' if args.quick else ''}: {', '.join(names)}", "",
             f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}. Load average at the start: {args.load:.1f} (the CPUs are shared "
             "with other jobs: wall times mean little unless it is near 0; sizes and RSS do not depend on it).", ""]
    for name, side in sides.items():
        lines.append(f"- {name}: {side['what']}")
    shape = "2 layers (the tests' TINY), hidden 128, max length 128" if args.quick else "3 layers, hidden 128, max length 512"
    lines += ["", f"Bundle: random gte-modernbert-base-shaped, {shape}, exported by each side's own exporter.", "",
              head, rule]
    if "venv_mb" in next(iter(sides.values())):
        lines.append(row("venv on disk (MB)", get("venv_mb"), lambda v: f"{v:,.0f}"))
        lines.append(row("packages installed", get("packages"), str, ratio=False))
        lines.append(row("torch, onnx, onnxscript, matplotlib installed", [", ".join(s["heavy"]) or "none"
                                                                             for s in sides.values()], str, ratio=False))
        lines.append(row("`python -c \"import torch\"`", ["works" if s["imports_torch"] else "fails"
                                                          for s in sides.values()], str, ratio=False))
    lines.append(row(f"`mbert-run embed` of one sentence: wall (s, median of {args.repeats})",
                     [s["embed"]["wall_s"] for s in sides.values()], lambda v: f"{v:.2f}"))
    lines.append(row("`mbert-run embed` of one sentence: peak RSS (MB)", [s["embed"]["rss_mb"] for s in sides.values()],
                     lambda v: f"{v:.0f}"))
    lines.append(row("`mbert-run info` works", ["yes" if s["info_ok"] else "NO" for s in sides.values()], str,
                     ratio=False))
    if all("serve" in s for s in sides.values()):
        lines.append(row("`mbert-run serve`: command start to ready (s)",
                         [s["serve"]["command_to_ready_s"] for s in sides.values()], lambda v: f"{v:.1f}"))
        lines.append(row("tritonserver start to ready (s)", [s["serve"]["server_to_ready_s"] for s in sides.values()],
                         lambda v: f"{v:.1f}"))
        for model in sorted({m.rsplit("_", 1)[-1] for s in sides.values() for m in s["serve"]["stubs"]}):
            lines.append(row(f"Triton Python model instance `*_{model}`: RSS (MB)",
                             [next((v for m, v in s["serve"]["stubs"].items() if m.endswith("_" + model)), None)
                              for s in sides.values()], lambda v: f"{v:.0f}"))
        lines.append(row("torch mapped in a Python model instance", ["yes" if s["serve"]["torch_in_stubs"] else "no"
                                                                     for s in sides.values()], str, ratio=False))
    lines.append(row(f"runtime: {texts} texts, {corpus_tokens} tokens, one encode() (s, median of 3)",
                     get("throughput_s"), lambda v: f"{v:.3f}"))
    lines.append(row("runtime tokens/s", [corpus_tokens / s["throughput_s"] for s in sides.values()],
                     lambda v: f"{v:,.0f}"))
    after = sides[names[-1]]
    lines += ["", f"{names[-1]} against the full install (the running Python, `export` extra) on the same bundle: "
              f"embed cosine {_cos(after['embed']['vector'], full['embed']):.7f}, max abs difference "
              f"{float(abs(after['embed']['vector'] - full['embed']).max()):.2e}" +
              (f"; served cosine {_cos(after['serve']['vector'], full['embed']):.7f}" if "serve" in after else "") + ".",
              ""]
    for name, side in sides.items():
        if "largest" in side:
            lines.append(f"Largest in {name}'s site-packages (MB): " +
                         ", ".join(f"{n} {mb:,.0f}" for n, mb in side["largest"]) + ".")
    lines += ["", "## Targets", ""]
    checks = []
    if "venv_mb" in after:
        checks.append(("`[cpu,serve]` venv <= 1 GB", f"{after['venv_mb']:,.0f} MB", after["venv_mb"] <= TARGETS["venv_mb"]))
        checks.append(("no torch in the serving venv (pip list)", after["torch"] or "none", after["torch"] is None))
    checks.append(("embed of one sentence <= 1.0 s wall", f"{after['embed']['wall_s']:.2f} s",
                   after["embed"]["wall_s"] <= TARGETS["embed_wall_s"]))
    checks.append(("embed of one sentence <= 200 MB peak RSS", f"{after['embed']['rss_mb']:.0f} MB",
                   after["embed"]["rss_mb"] <= TARGETS["embed_rss_mb"]))
    if len(sides) == 2:
        before = sides[names[0]]
        ratio = before["throughput_s"] / after["throughput_s"]
        checks.append(("no regression in runtime throughput (after / before >= 0.95, one shared-CPU run)",
                       f"{ratio:.2f}x", ratio >= 0.95))
    lines += ["| target | measured | |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'met' if ok else 'MISSED'} |" for t, m, ok in checks]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: the running Python only, no venvs")
    ap.add_argument("--before-rev", default="76943ce", help="the revision of the 'before' install")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mbert-footprint"),
                    help="venvs, the worktree, bundles (outside the repository)")
    ap.add_argument("--before-venv", type=Path, help="an existing 'before' venv (default WORK/before)")
    ap.add_argument("--after-venv", type=Path, help="an existing 'after' venv (default WORK/after)")
    ap.add_argument("--repeats", type=int, default=5, help="embed runs per side (--quick: 1)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="the results folder")
    ap.add_argument("--bundle", type=Path, help="with --quick: this bundle (exported by this checkout) instead of "
                    "exporting one (the smoke test passes a shared one)")
    args = ap.parse_args()
    if args.bundle and not args.quick:
        ap.error("--bundle is for --quick only: the full run exports each side's bundle with its own exporter")
    args.load = os.getloadavg()[0]
    if args.quick:
        args.repeats = 1
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec = QUICK_CORPUS if args.quick else CORPUS
    if args.bundle:
        after_bundle = args.bundle
    else:
        ck = tiny_checkpoint(work, args.quick)
        after_bundle = export([sys.executable, "-m", "mbert.export.cli"], ck, work / "bundle-after", spec["max_len"])
    corpus = build_corpus(after_bundle / TOKENIZER, spec)
    corpus_file = work / "corpus.json"
    corpus_file.write_text(json.dumps(corpus))
    from tokenizers import Tokenizer

    tokens = sum(len(e.ids) for e in Tokenizer.from_file(str(after_bundle / TOKENIZER)).encode_batch(corpus))
    from mbert.runtime import Encoder

    full = {"embed": Encoder.from_bundle(after_bundle, backend="onnxruntime", device="cpu").encode([SENTENCE])}
    sides: dict[str, dict] = {}
    if args.quick:
        sides["after"] = measure("after", Path(sys.executable), after_bundle, work, corpus_file, args.repeats, None)
        sides["after"]["what"] = f"the running Python ({sys.prefix}), this checkout"
    else:
        before_venv, after_venv = args.before_venv or work / "before", args.after_venv or work / "after"
        if not (before_venv / "bin" / "python").is_file():
            make_venv(before_venv, ["torch==2.13.0", f"{worktree(args.before_rev, work / 'old-main')}[cpu,serve]"])
        if not (after_venv / "bin" / "python").is_file():
            make_venv(after_venv, [f"{checkout_copy(work / 'new-main')}[cpu,serve]"])
        before_bundle = export([str(before_venv / "bin" / "mbert-export")], ck, work / "bundle-before", MAX_LEN)
        sides["before"] = measure("before", before_venv / "bin" / "python", before_bundle, work, corpus_file,
                                  args.repeats, before_venv)
        sides["before"]["what"] = (f"{args.before_rev}: `pip install 'torch==2.13.0' '.[cpu,serve]'` in a fresh venv "
                                   f"({before_venv}); torch {sides['before']['torch']}")
        sides["after"] = measure("after", after_venv / "bin" / "python", after_bundle, work, corpus_file,
                                 args.repeats, after_venv)
        sides["after"]["what"] = (f"this checkout: `pip install '.[cpu,serve]'` in a fresh venv ({after_venv}), "
                                  "pyproject.toml as it stood at the run")
    text = report(args, sides, full, tokens, len(corpus))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / ("serving_footprint_quick.md" if args.quick else "serving_footprint.md")
    out.write_text(text)
    print(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
