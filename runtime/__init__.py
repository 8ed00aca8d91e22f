"""mbert.runtime: serve exported bundles (TensorRT, ONNX Runtime or eager PyTorch) with one API.

    from mbert.runtime import Encoder

    enc = Encoder.from_bundle("engines/gte-modernbert-base")     # backend="auto"
    vectors = enc.encode(["a query", "a document"])                # float32 [2, 768]
    enc.backend_name, enc.last_stats.truncated

Attributes are imported on first use, so ``import mbert.runtime`` (and ``mbert-run --help``) stays
cheap; the heavy modules (torch, onnxruntime, tokenizers) load when an Encoder opens.
"""
from __future__ import annotations

from mbert.bundle.lazy import lazy_exports

_EXPORTS = {
    "Encoder": ".encoder",
    "EncodeStats": ".text",
    "pool": ".text",
    "plan_batches": ".text",
    "Backend": ".backends",
    "BackendStatus": ".backends",
    "open_backend": ".backends",
    "backend_statuses": ".backends",
    "OrtBackend": ".backends.onnxruntime",
    "TensorRTBackend": ".backends.tensorrt",
    "EagerBackend": ".eager",
    "padded_length": ".text",
    "engine_compatibility": ".backends.checks",
    "can_run": ".backends.checks",
    "check_engine": ".backends.checks",
    "TritonEncoder": ".serve.client",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
