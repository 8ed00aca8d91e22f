"""The naive all-FP16 conversion (what a user would otherwise run): written from a graph of the model,
validated on the same grid as ours and reported beside it, never gating."""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from mbert.bundle.validation import ValidationReport, compare
from mbert.runtime.backends.onnxruntime import onnx_runner


def naive_report(graph: Path, reference, cases, tolerances, on_case=None) -> tuple[ValidationReport | None, str | None]:
    """The same validation on the naive all-FP16 graph (:func:`write_naive_fp16` of ``graph``), what a
    user would otherwise run. Shown beside ours, never gating; (report, None), or (None, why) when
    the naive graph does not even run."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "naive.fp16.onnx"
        try:
            write_naive_fp16(graph, path)
            return compare("naive fp16 (onnxruntime float16 converter)", onnx_runner(path), reference, cases,
                           tolerances, on_case), None
        except Exception as exc:  # noqa: BLE001 - the naive path failing is a finding, not an export error
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def write_naive_fp16(graph: Path, path: Path) -> None:
    """The naive all-FP16 graph: onnxruntime's float16 converter on ``graph``, IO kept FP32.

    ``graph`` is a standard-ops graph of the model: the FP32 one, or the mixed FP16 graph (what the
    export passes: the FP32 ``model.onnx`` is in ONNX Runtime's fused form, which TensorRT cannot
    parse). The converter makes every float computation FP16, the plan's FP32 islands included (it
    rewrites ``Cast(to=FLOAT)`` into ``Cast(to=FLOAT16)``), so both give the same all-FP16 graph up
    to no-op casts; ``tests/test_precision.py`` checks that their outputs agree."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():  # it warns about every constant it clamps
        warnings.simplefilter("ignore")
        converted = convert_float_to_float16(onnx.load(str(graph)), keep_io_types=True)
    onnx.save(converted, str(path))
