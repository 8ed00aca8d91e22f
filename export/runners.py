"""Runners for the comparisons: ``ids, mask -> {output name: array}``."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from mbert.modeling.graph import Runner


def onnx_runner(path: Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None) -> Runner:
    """``path`` on ONNX Runtime."""
    import onnxruntime as ort

    from mbert.runtime.backends import session_options

    session = ort.InferenceSession(str(path), session_options(threads), providers=list(providers))
    names = [o.name for o in session.get_outputs()]

    def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"input_ids": ids, "attention_mask": mask})))

    return run
