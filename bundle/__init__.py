"""mbert.bundle: the contract between the exporter and everything that serves its output.

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
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mbert.modeling.config import ModernBertConfig

from .check import cross_check, model_info
from mbert.modeling.paths import inside
from .engine import (BuilderOptions, EngineRecord, EngineValidation, Gpu, NetworkCounts, PrecisionWalk, Profile,
                     SiteCheck, TensorRTVerdict)
from .int8 import BlindInt8Record, Int8Check, Int8Record, MatrixPlan, RetrievalRecord
from .manifest import (FORMAT_VERSION, IO, MANIFEST, FileEntry, GraphRecord, LayerKindError, Manifest, ModelInfo,
                       PrecisionRecord, Source, TritonRecord, read, read_raw, write)
from mbert.modeling.paths import RelPath, check_relpath

__all__ = [
    "Bundle", "open_bundle", "FORMAT_VERSION", "MANIFEST", "IO", "EngineRecord", "FileEntry", "GraphRecord",
    "LayerKindError", "Manifest", "ModelInfo", "PrecisionRecord", "Profile", "Source", "TritonRecord",
    "BuilderOptions", "EngineValidation", "Gpu", "NetworkCounts", "PrecisionWalk", "SiteCheck", "TensorRTVerdict",
    "RelPath", "check_relpath", "cross_check", "inside", "model_info", "read", "read_raw", "write",
    "BlindInt8Record", "Int8Check", "Int8Record", "MatrixPlan", "RetrievalRecord",
]


@dataclass(frozen=True)
class Bundle:
    """An opened bundle: its folder, its verified manifest and its config.json."""

    path: Path
    manifest: Manifest
    config: ModernBertConfig

    def path_of(self, rel: str, key: str = "path") -> Path:
        """The confined location of a file the manifest names."""
        return inside(self.path, rel, key)


def open_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open ``path``: the manifest's types, paths and seal are checked, with ``verify`` every file's
    sha256 too, and its values are cross-checked against the files; BundleError naming what differs."""
    path = Path(path)
    manifest = read(path, verify=verify)
    return Bundle(path, manifest, cross_check(path, manifest))
