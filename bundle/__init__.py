"""mbert.bundle: the contract between the exporter and everything that serves its output. It imports
no torch: a serving install runs without it.

A bundle is a folder: ONNX graphs, optionally a TensorRT plan, the checkpoint's tokenizer and
sentence-transformers files, the FP16 plan, a Triton repository, and ``manifest.json`` (a typed,
sealed :class:`Manifest`). This package is the only code that spells a manifest key, seals,
verifies, and confines paths; the exporter writes through it and the runtime reads through it::

    from mbert.bundle import open_bundle
    b = open_bundle("engines/gte-modernbert-base")   # verified: types, paths, seal, hashes, cross-checks
    b.manifest.graph("fp16").file, b.path_of(b.manifest.graph("fp16").file)

What verification proves: the manifest parses as this format, every path in it stays inside the
folder, it was not edited since it was sealed, every file is byte-for-byte the file that was sealed
(no file missing, changed or added), and its values agree with config.json, the pooling files and
the output contract. What it does not prove: who wrote the bundle (anyone can seal a folder: the
seal is a checksum, not a signature), or that the graphs compute the right thing on inputs other
than the validation grid the manifest records (``Encoder.check_parity`` re-runs that grid).

Names are imported on first use, so ``import mbert.bundle.errors`` (every command line's error
handling) stays light.
"""
from __future__ import annotations

from mbert.bundle.lazy import lazy_exports

_EXPORTS = {
    "Bundle": ".reader", "open_bundle": ".reader", "FORMAT_VERSION": ".manifest", "MANIFEST": ".names",
    "IO": ".manifest", "FileEntry": ".manifest", "GraphRecord": ".manifest", "LayerKindError": ".manifest",
    "Manifest": ".manifest", "ModelInfo": ".manifest", "PrecisionRecord": ".manifest", "Source": ".manifest",
    "TritonRecord": ".manifest", "read": ".manifest", "read_raw": ".manifest", "write": ".manifest",
    "EngineRecord": ".engine", "BuilderOptions": ".engine", "EngineValidation": ".engine", "Gpu": ".engine",
    "NetworkCounts": ".engine", "PrecisionWalk": ".engine", "Profile": ".engine", "SiteCheck": ".engine",
    "TensorRTVerdict": ".engine", "RelPath": ".paths", "check_relpath": ".paths", "inside": ".paths",
    "cross_check": ".check", "model_info": ".check", "BlindInt8Record": ".int8", "Int8Check": ".int8",
    "Int8Record": ".int8", "MatrixPlan": ".int8", "RetrievalRecord": ".int8",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
