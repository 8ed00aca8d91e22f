"""Bundles shared by the runtime tests (test_runtime*.py), each built once per test session.

Small random-weight checkpoints (hidden 256, 4 heads, intermediate 384, local attention 32, 3
layers; 1 for the head bundles) with real tokenizer files, exported with max_seq_len 128 so that ordinary text is
truncated and padded. Holds no tests itself.
"""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

from helpers import make_checkpoint

MAX_LEN = 128
SMALL = dict(num_hidden_layers=3, hidden_size=256, num_attention_heads=4, intermediate_size=384,
             local_attention=32)
HEAD = dict(SMALL, num_hidden_layers=1)  # heads need no local layers (the encoder bundles cover them)
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = [
    "It's time for tea.",
    "The quick brown fox jumps over the lazy dog.",
    "how do rotary position embeddings work?",
    "def add(a, b):\n    return a + b\n",
    "A short one.",
    "x",
    " ".join(["Sliding-window attention lets every token see its neighbours within a fixed band, while "
              "every third layer attends globally across the whole sequence."] * 12),  # > 128 tokens
    "Les modèles d'encodage produisent des vecteurs; 多语言文本 también funciona. " * 3,
    " ".join(f"item {i}: value {i * i}" for i in range(60)),  # > 128 tokens
    "What is the capital of France?",
]

_ROOT = Path(tempfile.mkdtemp(prefix="mbert-runtime-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _export(ck: Path, name: str, **options) -> Path:
    from mbert.export.pipeline import ExportOptions, export_bundle

    out = _ROOT / name
    export_bundle(ck, ExportOptions(out=out, max_seq_len=MAX_LEN, overwrite=True, **options))
    return out


@functools.cache
def checkpoint(kind: str) -> Path:
    """The checkpoint folder behind bundle(kind)."""
    folder = _ROOT / f"ck-{kind}"
    if kind == "cls":  # CLS pooling, no Normalize; prompts kept in pooling
        make_checkpoint(folder, base="gte-modernbert-base", layout="cls-pooling", seed=1, **SMALL)
        _write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": None})
    elif kind == "mean":  # mean + Normalize; prompts excluded from pooling
        make_checkpoint(folder, base="gte-modernbert-base", layout="mean-normalize", seed=2, **SMALL)
        _write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": None})
        _write_json(folder / "sentence_bert_config.json", {"max_seq_length": MAX_LEN, "do_lower_case": False})
        pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
        pool["include_prompt"] = False
        _write_json(folder / "1_Pooling" / "config.json", pool)
    elif kind == "seqcls":
        make_checkpoint(folder, base="modernbert-base", arch="ModernBertForSequenceClassification", seed=3,
                        id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, classifier_pooling="mean",
                        **HEAD)
    elif kind == "tokcls":
        make_checkpoint(folder, base="modernbert-base", arch="ModernBertForTokenClassification", seed=4,
                        id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, **HEAD)
    elif kind == "mlm":
        make_checkpoint(folder, base="modernbert-base", arch="ModernBertForMaskedLM", seed=5, **HEAD)
    else:
        raise KeyError(kind)
    return folder


@functools.cache
def bundle(kind: str) -> Path:
    """A bundle exported (FP32) from checkpoint(kind)."""
    return _export(checkpoint(kind), f"bundle-{kind}")


@functools.cache
def fp16_bundle() -> Path:
    """bundle("mean") plus a mixed-precision model.fp16.onnx made with the export's own steps (scan,
    plan, to_mixed_precision, to_onnx) and re-sealed. The same graph ``--fp16`` writes, without the
    export's FP16 validation, naive-conversion report and plot (35 s of a 3-minute test budget);
    the runtime's FP16 path is then judged by its own check_parity."""
    import torch

    from mbert.export.bundle import write_manifest
    from mbert.export.onnx import to_onnx
    from mbert.export.precision import plan, scan, to_mixed_precision
    from mbert.modeling import load_model, load_pooling

    out = _ROOT / "bundle-mean-fp16"
    shutil.copytree(bundle("mean"), out)
    model = load_model(checkpoint("mean"))
    g = torch.Generator().manual_seed(0)
    batches = [(ids := torch.randint(0, 50000, (2, n), generator=g), torch.ones_like(ids)) for n in (16, MAX_LEN)]
    the_plan = plan(scan(model, batches))
    to_onnx(to_mixed_precision(model, the_plan), out / "model.fp16.onnx", pooling=load_pooling(out),
            max_seq_len=MAX_LEN)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("files")
    manifest["artifacts"]["onnx_fp16"] = "model.fp16.onnx"
    manifest["precision"] = {"plan": None, "margin": the_plan.margin, "fp32_layers": the_plan.fp32_layers(),
                             "decisions": [], "max_abs_seen": 1.0}
    write_manifest(out, manifest)
    return out


def copy_bundle(kind: str, dest: Path) -> Path:
    """A private copy of bundle(kind) to tamper with."""
    shutil.copytree(bundle(kind), dest)
    return dest


def edit_manifest(folder: Path, edit, reseal: bool = True) -> None:
    """Edit a bundle's manifest. ``reseal`` recomputes its manifest_sha256 afterwards, as a careful
    hand-edit would, so that the runtime's cross-checks (not the digest) must catch the edit."""
    from mbert.export.bundle import manifest_digest

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    if reseal:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def sentence_transformer(kind: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(checkpoint(kind)), device="cpu")
    model.max_seq_length = MAX_LEN
    return model


def cosines(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
