"""The eager PyTorch reference behind the backend interface: the source checkpoint's model (a bundle
holds no PyTorch weights), FP32 only. It needs the exporter's extra (torch); every other backend
runs without it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mbert.bundle import Bundle
from mbert.bundle.errors import BundleError, MbertError
from mbert.bundle.names import CONFIG
from mbert.bundle.tensors import INPUT_NAMES, Runner
from mbert.runtime.text import Padding

EXPORT_EXTRA = "pip install 'mbert-export[export]'"


def require_torch(what: str) -> None:
    """BundleError naming the extra to install when torch (the exporter's extra) is missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise BundleError(f"{what} needs PyTorch and the eager model, which this install lacks: {EXPORT_EXTRA}") \
            from None


class EagerBackend(Padding):
    def __init__(self, graph_module, max_seq: int, artifact: str = "eager"):
        from mbert.modeling.graph import eager_runner

        self.runner = eager_runner(graph_module.eval())
        self.name, self.precision, self.artifact, self.max_seq = "eager", "fp32", artifact, max_seq
        self.input_names = list(INPUT_NAMES)
        self.output_names = list(graph_module.output_names)

    def run(self, input_ids, attention_mask, outputs=None):
        out = self.runner(input_ids, attention_mask)
        return {n: v for n, v in out.items() if not outputs or n in outputs}


def eager_source(bundle: Bundle, source: str | Path | None = None) -> str | Path:
    """Where the eager model comes from: ``source`` if given, else the exported folder if it still
    exists, else the hub id; BundleError naming what is needed when none is available (a bundle
    holds no PyTorch weights)."""
    if source is not None:
        return source
    src = bundle.manifest.source
    try:
        here = (Path(src.path) / CONFIG).is_file()
    except OSError:  # in a folder this user cannot enter (another user's export): not available here
        here = False
    if here:
        return Path(src.path)
    if src.id:
        return src.id
    raise BundleError(
        f"{bundle.path}: the eager PyTorch backend needs the checkpoint this bundle was exported from "
        f"({src.given}), because a bundle holds no PyTorch weights; it is not at {src.path} and the manifest "
        "names no hub id. Pass source=FOLDER (--source FOLDER)")


def load_eager_model(bundle: Bundle, source: str | Path | None = None, device: Any = "cpu"):
    """The source checkpoint's eager model, checked to be the one the bundle was exported from."""
    require_torch("the eager backend")
    from mbert.modeling import load_model

    where = eager_source(bundle, source)
    revision = bundle.manifest.source.revision if source is None else None
    try:
        model = load_model(where, device=device, task=bundle.manifest.task, revision=revision)
    except MbertError as exc:
        raise BundleError(f"{bundle.path}: the eager backend needs the source checkpoint {where}, which could not "
                          f"be loaded: {exc}") from exc
    ours = json.loads((bundle.path / CONFIG).read_text(encoding="utf-8"))
    theirs = json.loads((Path(model.source.path) / CONFIG).read_text(encoding="utf-8"))
    if ours != theirs:
        raise BundleError(f"{bundle.path}: the source checkpoint {where} has a different {CONFIG} than the "
                          "bundle; it changed since export (pass the original checkpoint as source, or re-export)")
    return model


def open_eager(bundle: Bundle, source: str | Path | None, device: str) -> EagerBackend:
    """The eager backend of ``bundle``: its source checkpoint's model, then pooling, on ``device``."""
    require_torch("the eager backend")
    from mbert.modeling.graph import GraphModule

    model = load_eager_model(bundle, source, device=device)
    return EagerBackend(GraphModule(model, bundle.manifest.pooling), bundle.manifest.max_seq_len,
                        artifact=str(model.source.path))


def eager_reference(bundle: Bundle, source: str | Path | None = None) -> Runner:
    """The eager FP32 model of ``bundle``'s source checkpoint as a runner: the reference of parity checks."""
    require_torch("a parity check against the eager model")
    from mbert.modeling.graph import GraphModule, eager_runner

    model = load_eager_model(bundle, source)
    return eager_runner(GraphModule(model, bundle.manifest.pooling).eval())
