"""The manifest: one typed record of what a bundle holds, written and read by this module only.

``manifest.json`` is :class:`Manifest` as JSON (:mod:`mbert.bundle.schema`: the dataclass fields are
the keys). It is sealed: ``files`` holds the size and sha256 of every file of the bundle (``triton/``
included) and ``manifest_sha256`` the sha256 of the canonical JSON of every other key. A bundle of
the current format without a valid seal, of another format, or whose files differ from the table is
refused with a :class:`BundleError` naming what differs.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from mbert.bundle import files as files_mod
from mbert.bundle.engine import EngineRecord, TensorRTVerdict
from mbert.bundle.errors import BundleError
from mbert.bundle.files import read_json
from mbert.bundle.int8 import Int8Record
from mbert.bundle.names import MANIFEST, TRITON_ENCODERS
from mbert.bundle.pooling import PoolingConfig
from mbert.bundle.schema import RelPath, from_json, to_json
from mbert.bundle.tensors import TensorSpec
from mbert.bundle.validation import ValidationReport

FORMAT_VERSION = 2
KNOWN_FORMATS = (1, 2)  # 1: mbert-export 0.1 (an untyped manifest): recognised, never opened
REEXPORT = "re-export the model with this mbert-export (mbert-export SOURCE --out BUNDLE --overwrite)"
Task = Literal["encoder", "masked-lm", "sequence-classification", "token-classification"]
Precision = Literal["fp32", "fp16", "int8"]
TritonEncoder = Literal[TRITON_ENCODERS]


@dataclass(frozen=True)
class Source:
    """Where the weights came from: provenance. The runtime reads the checkpoint only when asked for
    the eager backend or a parity check, and only from ``source=`` or these values."""

    given: str  # what the user passed (hub id or folder)
    path: str  # the resolved local folder at export time
    id: str | None = None  # hub id
    revision: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    local_attention: int
    vocab_size: int
    pad_token_id: int
    cls_token_id: int | None
    sep_token_id: int | None


@dataclass(frozen=True)
class IO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)


@dataclass(frozen=True)
class GraphRecord:
    """An ONNX graph of the bundle, what runs it, and its validation against the eager model."""

    file: RelPath
    precision: Precision
    runtimes: tuple[str, ...]  # "onnxruntime", "tensorrt"
    opset: int
    validation: ValidationReport


@dataclass(frozen=True)
class LayerKindError:
    worst_cosine: float | None
    max_abs_error: float | None


@dataclass(frozen=True)
class PrecisionRecord:
    """The FP16 scan and plan (``plan`` is precision.json, ``plot`` its picture)."""

    plan: RelPath
    plot: RelPath
    margin: float
    fp32_layers: tuple[int, ...]
    decisions: tuple[str, ...]
    max_abs_seen: float
    per_layer_kind: dict[str, LayerKindError]
    naive_fp16: ValidationReport | None  # the naive all-FP16 conversion on the same grid (reference only)
    naive_fp16_error: str | None = None  # why the naive conversion could not even run
    naive_fp16_tensorrt: TensorRTVerdict | None = None  # TensorRT's verdict on the naive graph (None: no builder)


@dataclass(frozen=True)
class TritonRecord:
    """The Triton model repository of the bundle, as written (enough to write it again)."""

    repository: RelPath  # the model repository folder ("triton")
    ensemble: str  # the ensemble's model name
    encoder: TritonEncoder  # the encoder the ensemble routes to
    max_batch: int
    length_buckets: tuple[int, ...]  # padded lengths the tokenizer model emits
    ensemble_outputs: tuple[str, ...]


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    format_version: int
    name: str
    created: str
    source: Source
    tool_versions: dict[str, str]
    task: Task
    labels: dict[str, str] | None
    model: ModelInfo
    max_seq_len: int
    io: IO
    pooling: PoolingConfig | None
    graphs: tuple[GraphRecord, ...]
    precision: PrecisionRecord | None = None
    engine: EngineRecord | None = None
    triton: TritonRecord | None = None
    int8: Int8Record | None = None  # the INT8 plan of model.int8.onnx (--int8)
    files: dict[RelPath, FileEntry] = field(default_factory=dict)
    manifest_sha256: str = ""

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version}, this mbert-export writes {FORMAT_VERSION}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")

    def graph(self, precision: str) -> GraphRecord | None:
        """The bundle's graph of ``precision`` ("fp32", "fp16", "int8"), or None."""
        return next((g for g in self.graphs if g.precision == precision), None)

    def referenced_files(self) -> list[tuple[str, RelPath]]:
        """(key, path) of every bundle file a record points to."""
        refs = [(f"graphs[{i}].file", g.file) for i, g in enumerate(self.graphs)]
        if self.precision is not None:
            refs += [("precision.plan", self.precision.plan), ("precision.plot", self.precision.plot)]
        if self.engine is not None:
            refs += [("engine.file", self.engine.file), ("engine.onnx", self.engine.onnx),
                     ("engine.build_log", self.engine.build_log),
                     ("engine.precision_walk.file", self.engine.precision_walk.file)]
        if self.int8 is not None:
            refs += [("int8.plan", self.int8.plan), ("int8.plot", self.int8.plot)]
        return refs

    def digest(self) -> str:
        return manifest_digest(to_json(self))


def manifest_digest(raw: dict) -> str:
    """The seal of a manifest as JSON: sha256 of the canonical JSON of every key but ``manifest_sha256``."""
    body = {k: v for k, v in raw.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(folder: Path, manifest: Manifest) -> Manifest:
    """``manifest`` with the files table of ``folder`` (every file but the manifest) and its seal."""
    table = {rel: FileEntry(files_mod.sha256(folder / rel), (folder / rel).stat().st_size)
             for rel in files_mod.walk(folder, skip=[MANIFEST])}
    unsealed = replace(manifest, files=table, manifest_sha256="")
    missing = [f"{key} ({rel})" for key, rel in unsealed.referenced_files() if rel not in table]
    assert not missing, f"records point to files the bundle lacks: {missing}"
    return replace(unsealed, manifest_sha256=unsealed.digest())


def write(folder: Path, manifest: Manifest) -> Manifest:
    """Seal ``manifest`` over ``folder`` and write it as ``manifest.json`` (atomically); returns it."""
    sealed = seal(folder, manifest)
    text = json.dumps(to_json(sealed), indent=2, allow_nan=False) + "\n"
    files_mod.atomic_write(folder / MANIFEST, text)
    return sealed


def read_raw(folder: Path) -> dict:
    """The parsed manifest.json of ``folder`` (a JSON object), with its format version checked."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such bundle folder")
    if not path.is_file() or path.is_symlink():
        raise BundleError(f"{folder}: no {MANIFEST}; not a bundle, or an interrupted export")
    raw = read_json(path, BundleError)
    if not isinstance(raw, dict):
        raise BundleError(f"{path}: expected a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        known = "an older" if version in KNOWN_FORMATS else "an unknown"
        raise BundleError(f"{path}: format_version {version!r} is {known} bundle format; this mbert-export "
                          f"reads format {FORMAT_VERSION}: {REEXPORT}")
    return raw


def read(folder: Path, verify: bool = True) -> Manifest:
    """The typed manifest of ``folder``. Types, paths and seal are always checked; with ``verify``
    every file is hashed against the table and unlisted files are refused."""
    folder = Path(folder)
    raw = read_raw(folder)
    manifest = from_json(Manifest, raw, "")
    path = folder / MANIFEST
    if not manifest.manifest_sha256:
        raise BundleError(f"{path}: manifest_sha256: the seal is missing; {REEXPORT}")
    if manifest.manifest_sha256 != manifest_digest(raw):
        raise BundleError(f"{path}: manifest_sha256 does not match the manifest's content (edited after export); "
                          f"{REEXPORT} rather than editing it")
    for key, rel in manifest.referenced_files():
        if rel not in manifest.files:
            raise BundleError(f"{path}: {key}: {rel!r} is not covered by the manifest's file hashes; {REEXPORT}")
        files_mod.inside(folder, rel, key)
    if manifest.triton is not None:
        repo = manifest.triton.repository
        files_mod.inside(folder, repo, "triton.repository")
        if not any(f.startswith(f"{repo}/") for f in manifest.files):
            raise BundleError(f"{path}: triton.repository: no sealed file lies in {repo!r}")
    if verify:
        problems = files_mod.mismatches(folder, manifest.files, skip=[MANIFEST])
        if problems:
            raise BundleError(f"{folder}: bundle does not match its manifest: {'; '.join(problems)}; "
                              f"{REEXPORT} rather than editing bundle files")
    return manifest
