"""Cross-checks of a sealed manifest against the bundle's own files.

The seal proves the manifest was not edited since it was sealed, not that what it says is true of
the files beside it (a resealed edit, a bug). So its values are compared with the hashed files they
derive from: ``model``, ``task`` and ``labels`` with ``config.json``; ``pooling`` with ``modules.json``
and friends; ``io`` with the output contract (:func:`mbert.modeling.graph.output_specs`) of the task
and pooling; ``max_seq_len`` with ``max_position_embeddings``.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import BundleError, MbertError
from mbert.bundle.manifest import REEXPORT, Manifest, ModelInfo
from mbert.bundle.names import CONFIG, MANIFEST
from mbert.bundle.pooling import read_pooling
from mbert.bundle.tensors import input_specs, output_specs


def model_info(cfg: ModernBertConfig) -> ModelInfo:
    """The manifest's ``model`` record of a config (the exporter writes it, the runtime compares it)."""
    return ModelInfo(**{k: getattr(cfg, k) for k in ModelInfo.__dataclass_fields__})


def cross_check(folder: Path, manifest: Manifest) -> ModernBertConfig:
    """BundleError listing every value of ``manifest`` that its files contradict; returns config.json."""
    if CONFIG not in manifest.files:
        raise BundleError(f"{folder}: the manifest lists no {CONFIG}; {REEXPORT}")
    try:
        cfg = ModernBertConfig.from_file(folder / CONFIG)
        declared = read_pooling(folder) if manifest.task == "encoder" else None
    except MbertError as exc:
        raise BundleError(f"{folder}: {exc}") from exc
    problems = []
    if manifest.task != "encoder" and manifest.task != cfg.task:
        problems.append(f"task is {manifest.task!r} in the manifest, {cfg.task!r} in {CONFIG}")
    want = model_info(cfg)
    for key, value in asdict(manifest.model).items():
        if value != getattr(want, key):
            problems.append(f"model.{key} is {value!r} in the manifest, {getattr(want, key)!r} in {CONFIG}")
    labels = {str(k): v for k, v in cfg.id2label.items()} or None
    if manifest.task in ("sequence-classification", "token-classification") and manifest.labels != labels:
        problems.append(f"labels are {manifest.labels!r} in the manifest, {labels!r} in {CONFIG}")
    if manifest.max_seq_len > cfg.max_position_embeddings:
        problems.append(f"max_seq_len {manifest.max_seq_len} exceeds max_position_embeddings "
                        f"{cfg.max_position_embeddings} of {CONFIG}")
    if manifest.pooling != declared:
        problems.append(f"pooling is {manifest.pooling!r} in the manifest, but modules.json / 1_Pooling / "
                        f"sentence_bert_config.json declare {declared!r}")
    outputs = output_specs(manifest.task, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                           num_labels=cfg.num_labels, pooling_modes=declared.modes if declared else None)
    if manifest.io.outputs != outputs:
        problems.append(f"io.outputs are {list(manifest.io.outputs)}; a {manifest.task} bundle with this config "
                        f"and pooling has {list(outputs)}")
    if manifest.io.inputs != input_specs():
        problems.append(f"io.inputs are {list(manifest.io.inputs)}, expected {list(input_specs())}")
    if manifest.graph("fp32") is None:
        problems.append("graphs has no fp32 graph")
    if (manifest.graph("int8") is None) != (manifest.int8 is None):
        problems.append("an int8 graph and the int8 plan record come together; the manifest has only one of them")
    if problems:
        raise BundleError(f"{folder}: {MANIFEST} does not match the bundle's files: " + "; ".join(problems)
                          + f"; {REEXPORT}")
    return cfg
