"""The bundle: a self-describing folder the runtime, C++ callers and Triton load.

Layout (``engines/<model-name>/``)::

    manifest.json            format version, source, hashes, opset, tool versions, IO, pooling,
                             max length, validation results (written last)
    model.onnx[.data]        FP32 graph
    model.fp16.onnx          mixed-precision graph (--fp16)
    precision.json/.png      FP16 scan and plan (--fp16)
    model.plan               TensorRT engine (when built)
    config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    modules.json, 1_Pooling/config.json, sentence_bert_config.json,
    config_sentence_transformers.json   (whichever the checkpoint has)
    triton/                  Triton model repository

A bundle is written into a hidden sibling folder and renamed into place only when complete, so an
interrupted export never leaves a folder that looks like a bundle.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from mbert.modeling.checkpoint import SIDE_FILES
from mbert.modeling.errors import BundleError, read_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The checkpoint's tokenizer and sentence-transformers files (the weights travel inside the ONNX).
COPIED_FILES = tuple(name for name in SIDE_FILES if "*" not in name)

@contextlib.contextmanager
def staging(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``out``; on any error it is removed."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise BundleError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise BundleError(f"{out}: exists and is not a bundle; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if not (tmp / MANIFEST).is_file():
            raise BundleError(f"{out}: internal error, the bundle has no manifest")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and sentence-transformers files the runtime needs; returns their names."""
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    modules = src / "modules.json"
    if modules.is_file():
        for entry in json.loads(modules.read_text(encoding="utf-8")):
            sub = entry.get("path") or ""
            if sub and (src / sub / "config.json").is_file():
                (dst / sub).mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / sub / "config.json", dst / sub / "config.json")
                copied.append(f"{sub}/config.json")
    return copied


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_table(folder: Path) -> dict[str, dict]:
    """sha256 and size of every file in the bundle (the manifest and the triton/ copies excluded)."""
    table = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST and not rel.startswith(("triton/", "triton_pending/")):
            table[rel] = {"sha256": sha256(path), "bytes": path.stat().st_size}
    return table


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without the ``manifest_sha256`` key itself, so an
    edit to any recorded value (max_seq_len, io, pooling, ...) is detected, not only file swaps."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(folder: Path, manifest: dict) -> None:
    manifest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest = dict(manifest, format_version=FORMAT_VERSION, files=file_table(folder))
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def read_manifest(bundle: Path, verify: bool = True) -> dict:
    """The bundle's manifest; with ``verify`` every file hash is checked and differences are named."""
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: no such bundle folder")
    if not path.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST}; not a bundle, or an interrupted export")
    manifest = read_json(path, BundleError)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{path}: format version {version!r}, this mbert-export reads version {FORMAT_VERSION}; "
            "re-export the model with this version (mbert-export --overwrite ...)"
        )
    if verify:
        if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_digest(manifest):
            raise BundleError(f"{path}: edited after export (manifest_sha256 does not match its content); "
                              "re-export the model (mbert-export --overwrite ...) rather than editing the manifest")
        verify_files(bundle, manifest)
    return manifest


def verify_files(bundle: Path, manifest: dict, names: list[str] | None = None) -> None:
    files = manifest.get("files") or {}
    problems = []
    for name in names if names is not None else sorted(files):
        entry = files.get(name)
        path = bundle / name
        if entry is None:
            problems.append(f"{name} is not listed in the manifest")
        elif not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            problems.append(f"{name} differs from the file the manifest recorded (sha256 mismatch)")
    if problems:
        raise BundleError(
            f"{bundle}: bundle does not match its manifest: {'; '.join(problems)}. "
            "Re-export it (mbert-export --overwrite ...) rather than editing bundle files"
        )
