"""mbert.runtime: serve exported bundles (TensorRT, ONNX Runtime or eager PyTorch) with one API.

    from mbert.runtime import Encoder

    enc = Encoder.from_bundle("engines/gte-modernbert-base")     # backend="auto"
    vectors = enc.encode(["a query", "a document"])                # float32 [2, 768]
    enc.backend_name, enc.last_stats.truncated

Attributes are imported on first use, so ``import mbert.runtime`` (and ``mbert-run --help``) stays
cheap; the heavy modules (torch, onnxruntime, tokenizers) load when an Encoder opens.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Encoder": ".encoder",
    "EncodeStats": ".text",
    "Backend": ".backends",
    "BackendStatus": ".backends",
    "OrtBackend": ".backends",
    "TensorRTBackend": ".backends",
    "EagerBackend": ".backends",
    "open_backend": ".backends",
    "backend_statuses": ".backends",
    "padded_length": ".backends",
    "open_manifest": ".checks",
    "check_manifest": ".checks",
    "engine_problems": ".checks",
    "check_engine": ".checks",
    "manifest_digest": ".checks",
    "pool": ".text",
    "plan_batches": ".text",
    "TritonEncoder": ".triton_client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
