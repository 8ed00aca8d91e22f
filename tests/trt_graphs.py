"""The small overflow checkpoint's graphs, made once per test session for the TensorRT tests.

3 layers (layer 0 global, 1-2 local), hidden 128; layer 1's MLP output matrix is scaled x30000 so
its MLP output and the residual stream after it exceed FP16 (as in ``test_precision.py``). The
scan and plan are the project's own, so the plan keeps layer 1's MLP and the residual of layers
1-2 (and the final norm) in FP32, everything else FP16.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from helpers import TEXTS, make_checkpoint

OVERFLOW_LAYER = 1
SMALL = dict(num_hidden_layers=3, hidden_size=128, num_attention_heads=2, intermediate_size=192,
             local_attention=16)
_CACHE: dict[str, "Graphs"] = {}


@dataclass(frozen=True)
class Graphs:
    folder: Path
    fp32: Path  # model.onnx
    fp16: Path  # model.fp16.onnx: the plan's mixed precision
    naive: Path  # onnxruntime's float16 converter on model.onnx (what naive_report builds)
    plan: object  # mbert.export.precision.Plan
    heads: int


def overflow_graphs(tmp_path_factory) -> Graphs:
    if "overflow" not in _CACHE:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        from mbert.export.onnx import to_onnx
        from mbert.export.precision import plan, scan, to_mixed_precision
        from mbert.modeling import load_model

        root = tmp_path_factory.mktemp("trt-overflow")
        folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=31, scale_layer_mlp=(OVERFLOW_LAYER, 30000.0),
                                 **SMALL)
        model = load_model(folder)
        the_plan = plan(scan(model, TEXTS * 4, max_len=128))
        to_onnx(model, root / "model.onnx", max_seq_len=256)
        to_onnx(to_mixed_precision(model, the_plan), root / "model.fp16.onnx", max_seq_len=256)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            naive = convert_float_to_float16(onnx.load(str(root / "model.onnx")), keep_io_types=True)
        onnx.save(naive, str(root / "naive.fp16.onnx"))
        _CACHE["overflow"] = Graphs(folder, root / "model.onnx", root / "model.fp16.onnx", root / "naive.fp16.onnx",
                                    the_plan, SMALL["num_attention_heads"])
    return _CACHE["overflow"]
