"""The TensorRT tests' shared pieces.

* :func:`overflow_graphs`: the small overflow checkpoint's graphs, made once per session. 3 layers
  (layer 0 global, 1-2 local), hidden 128; layer 1's MLP output matrix is scaled x30000 so its MLP
  output and the residual stream after it exceed FP16 (as in ``test_precision.py``). The scan and
  plan are the project's own, so the plan keeps layer 1's MLP and the residual of layers 1-2 (and
  the final norm) in FP32, everything else FP16.
* :func:`export_rtx_bundle`: ``mbert-export CKPT --fp16 --engine tensorrt-rtx --compute-capability
  8.6,12.0`` on a small checkpoint whose layer 2 overflows FP16, run once per session by the
  ``rtx_export`` fixture (``conftest.py``).
* :func:`rtx_record` / :func:`datacenter_record`: engine records for the compatibility rules.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from helpers import SMALL, TEXTS, make_checkpoint

OVERFLOW_LAYER = 1
OVERFLOW = dict(SMALL, num_hidden_layers=3, local_attention=16)
RTX_EXPORT_TARGETS = ("8.6", "12.0")
_CACHE: dict[str, "Graphs"] = {}


@dataclass(frozen=True)
class Graphs:
    folder: Path
    fp32: Path  # model.onnx
    fp16: Path  # model.fp16.onnx: the plan's mixed precision
    naive: Path  # onnxruntime's float16 converter on model.onnx (what naive_report builds)
    plan: object  # mbert.export.fp16.precision.Plan
    heads: int


def overflow_graphs(tmp_path_factory) -> Graphs:
    if "overflow" not in _CACHE:
        from mbert.export.fp16.naive import write_naive_fp16
        from mbert.export.fp16.precision import plan, scan, to_mixed_precision
        from mbert.export.onnx.trace import to_onnx
        from mbert.modeling import load_model

        root = tmp_path_factory.mktemp("trt-overflow")
        folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=31, scale_layer_mlp=(OVERFLOW_LAYER, 30000.0),
                                 **OVERFLOW)
        model = load_model(folder)
        the_plan = plan(scan(model, TEXTS * 4, max_len=128))
        to_onnx(model, root / "model.onnx", max_seq_len=256)
        to_onnx(to_mixed_precision(model, the_plan), root / "model.fp16.onnx", max_seq_len=256)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            write_naive_fp16(root / "model.onnx", root / "naive.fp16.onnx")
        _CACHE["overflow"] = Graphs(folder, root / "model.onnx", root / "model.fp16.onnx", root / "naive.fp16.onnx",
                                    the_plan, OVERFLOW["num_attention_heads"])
    return _CACHE["overflow"]


def cli(*args, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mbert.export.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def export_rtx_bundle(root: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """(the finished ``mbert-export`` process, the checkpoint, the bundle): layer 2's MLP output x30000
    overflows FP16, so the plan keeps layer 2's MLP and residual and the final norm FP32."""
    folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=32, layout="cls-pooling",
                             scale_layer_mlp=(2, 30000.0), **dict(SMALL, num_hidden_layers=3))
    out = root / "bundle"
    proc = cli(folder, "--out", out, "--fp16", "--max-seq-len", "256", "--engine", "tensorrt-rtx",
               "--compute-capability", ",".join(RTX_EXPORT_TARGETS))
    assert proc.returncode == 0, proc.stderr
    return proc, folder, out


# --- engine records for the compatibility rules ------------------------------------------------------

def walk_record(onnx: str = "model.fp16.onnx", family: str = "tensorrt-rtx", version: str = "1.7.1.116"):
    """A passed precision walk with one site (the records' consistency checks need one)."""
    from mbert.bundle.engine import NetworkCounts, PrecisionWalk, SiteCheck

    site = SiteCheck("layers.0.mlp", 0, "mlp", "float16", "float16", "matrix products", 2, 0, 4, 1, True, "")
    return PrecisionWalk("tensorrt_precision.json", onnx, family, version, (site,),
                         NetworkCounts(20, 4, 0, 1, 3, 15, 2, 3, 0), {}, ())


def rtx_record(**changes):
    from mbert.bundle.engine import BuilderOptions, EngineRecord, Profile

    base = EngineRecord(
        file="model.plan", onnx="model.fp16.onnx", family="tensorrt-rtx", version="1.7.1.116",
        profiles=(Profile((1, 1), (4, 128), (8, 128)), Profile((1, 129), (4, 512), (8, 512))), targets=("8.6",),
        built_on=None, options=BuilderOptions(64.0, 3, False, True, False, False), build_seconds=3.5,
        build_log="tensorrt_build.log", precision_walk=walk_record(), validation=None,
        not_run_reason="built on a machine without a CUDA GPU")
    return replace(base, **changes)


def datacenter_record(**changes):
    from mbert.bundle.engine import BuilderOptions, Gpu

    base = rtx_record(family="tensorrt", version="10.13.3.9", targets=(), built_on=Gpu("NVIDIA H100 80GB HBM3", "9.0"),
                      options=BuilderOptions(80.0, 3, False, True, False, True),
                      precision_walk=walk_record(family="tensorrt", version="10.13.3.9"))
    return replace(base, **changes)
