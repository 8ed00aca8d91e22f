"""Every benchmark's smoke form runs: its ``--quick`` (or ``--small``) form, on a tiny model, writes its
report into a temporary folder, and that report holds its table. So an API change cannot break a
benchmark silently. The committed results in ``benchmarks/results/`` are never written (checked).

``gpu_fp16.py`` measures the FP16 plan in PyTorch on a CUDA GPU; its smoke form runs on the CPU
(``--small --device cpu``), which checks the script and the plan's arithmetic, not GPU speed.
``cpp_client.py`` is run by ``tests/test_cpp_client.py``.

The serving-side smoke forms (``runtime_cpu``, ``triton_serve``, ``serving_footprint``) measure a bundle
they did not export, so they share one: the tests' 2-layer ``TINY`` checkpoint exported once per module
(``shared_bundle``) and passed with ``--bundle``; ``int8_cpu`` and the others export their own, as the
export is part of what they measure."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MAX_LEN, TINY, make_checkpoint, snapshot

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"


@pytest.fixture(autouse=True)
def committed_results_untouched():
    before = snapshot(RESULTS)
    yield
    assert snapshot(RESULTS) == before, "a smoke run wrote into benchmarks/results/"


@pytest.fixture(scope="module")
def shared_bundle(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, bundle): TINY, gte-modernbert-base-shaped with CLS pooling, exported at MAX_LEN tokens."""
    from mbert.export.options import ExportOptions
    from mbert.export.pipeline import export_bundle

    root = tmp_path_factory.mktemp("shared")
    ck = make_checkpoint(root / "checkpoint", base="gte-modernbert-base", layout="cls-pooling", seed=0, **TINY)
    export_bundle(ck, ExportOptions(out=root / "bundle", max_seq_len=MAX_LEN, engine="none"))
    return ck, root / "bundle"


def bench(script: str, *args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python benchmarks/SCRIPT ARGS`` in ``cwd``, in its own process group (killed whole on timeout)."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / script), *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} ran past {timeout}s: {err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{err[-4000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table(report: Path, *rows: str) -> str:
    """The report's text, after checking it has a Markdown table with a row starting with each of ``rows``."""
    assert report.is_file(), f"{report} was not written"
    text = report.read_text()
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) >= 3 and set(lines[1].replace("|", "").strip()) <= set("-: "), text
    for row in rows:
        assert any(line.startswith(f"| {row}") for line in lines), f"no row {row!r} in {report}:\n{text}"
    return text


def test_onnx_cpu_and_ort_profile(tmp_path):
    # hf-onnx (transformers' own torch.onnx.export, most of this form's time) is left to the full run
    bench("onnx_cpu.py", "--quick", "--small", "--systems", "ours-ort,ours-trt", "--out", tmp_path,
          "--cache", tmp_path / "cache", cwd=tmp_path)
    text = table(tmp_path / "onnx_cpu_quick.md", "2x128", "1x512")
    assert "SMOKE TEST" in text
    done = bench("ort_profile.py", "2x128", "--cache", tmp_path / "cache" / "tiny", cwd=tmp_path)
    assert "ORT profile of ours-ort at 2x128" in done.stdout and "all nodes" in done.stdout, done.stdout


def test_export_time(tmp_path):
    # "before" (the baseline revision b06b5a7, git-archived, its sequential pipeline: most of this form's
    # time) is left to the full run
    bench("export_time.py", "--quick", "--systems", "after", "--out", tmp_path, "--cache", tmp_path / "cache",
          cwd=tmp_path)
    text = table(tmp_path / "export_time_quick.md", "trace (background)", "scan", "total")
    assert "## after" in text and "failed" not in text, text


def test_floor(tmp_path):
    bench("floor.py", "--quick", "--out", tmp_path, cwd=tmp_path)
    table(tmp_path / "floor_quick.md", "torch mm", "ORT MatMul", "FP16 scan")


def test_runtime_cpu(tmp_path, shared_bundle):
    ck, bundle = shared_bundle
    bench("runtime_cpu.py", "--quick", "--out", tmp_path / "runtime_cpu_quick.md", "--cache", tmp_path / "cache",
          "--ck", ck, "--bundle", bundle, cwd=tmp_path)
    text = table(tmp_path / "runtime_cpu_quick.md", "mbert-runtime", "st-torch")
    assert "| mbert-runtime | - |" not in text, text  # it ran (a failed system is reported with dashes)


def test_gpu_fp16_runs_on_the_cpu(tmp_path):
    bench("gpu_fp16.py", "--small", "--device", "cpu", "--repeats", "1", "--out", tmp_path, cwd=tmp_path)
    table(tmp_path / "gpu_fp16.md")


def test_int8_cpu(tmp_path):
    bench("int8_cpu.py", "--quick", "--repeats", "1", "--out", tmp_path / "int8_cpu_quick.md", "--cache",
          tmp_path / "cache", cwd=tmp_path)
    table(tmp_path / "int8_cpu_quick.md", "fp32")


def test_tensorrt_build(tmp_path):
    bench("tensorrt_build.py", "--quick", "--out", tmp_path, "--cache", tmp_path / "cache", cwd=tmp_path, timeout=900)
    table(tmp_path / "tensorrt_build_quick.md")


def test_triton_serve(tmp_path, shared_bundle):
    bench("triton_serve.py", "--quick", "--out", tmp_path / "triton_serve_quick.md", "--cache", tmp_path / "cache",
          "--bundle", shared_bundle[1], cwd=tmp_path)
    text = table(tmp_path / "triton_serve_quick.md", "in-process Encoder.encode", "served (Triton)")
    assert "Failed requests: 0." in text, text


def test_serving_footprint(tmp_path, shared_bundle):
    bench("serving_footprint.py", "--quick", "--work", tmp_path / "work", "--out", tmp_path,
          "--bundle", shared_bundle[1], cwd=tmp_path)
    text = table(tmp_path / "serving_footprint_quick.md", "`mbert-run embed` of one sentence: wall",
                 "`mbert-run embed` of one sentence: peak RSS", "runtime tokens/s")
    assert "embed cosine 1.0000000" in text, text
