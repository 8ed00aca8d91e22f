"""The output contract of an exported graph: its inputs, and the outputs a bundle of a given task
and pooling has, with their dtypes and shapes.

One table (:func:`output_specs`): the module the exporter traces (``mbert.modeling.graph.GraphModule``),
the bundle's cross-checks, the runtime and the Triton repository writer all read it, so they cannot
disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

INPUT_NAMES = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, dtype (numpy spelling) and shape; a str dimension is
    symbolic (``"batch"``, ``"sequence"``)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


def input_specs() -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, "int64", ("batch", "sequence")) for n in INPUT_NAMES)


def output_specs(task: str, *, hidden_size: int, vocab_size: int, num_labels: int,
                 pooling_modes: tuple[str, ...] | None) -> tuple[TensorSpec, ...]:
    """The outputs a graph of ``task`` has; ``pooling_modes`` (encoder only) adds ``sentence_embedding``."""
    if task == "encoder":
        specs = [TensorSpec("last_hidden_state", "float32", ("batch", "sequence", hidden_size))]
        if pooling_modes:
            specs.append(TensorSpec("sentence_embedding", "float32", ("batch", hidden_size * len(pooling_modes))))
        return tuple(specs)
    logits = {
        "masked-lm": ("batch", "sequence", vocab_size),
        "sequence-classification": ("batch", num_labels),
        "token-classification": ("batch", "sequence", num_labels),
    }[task]
    return (TensorSpec("logits", "float32", logits),)


# ``ids, mask -> {output name: float32 array}``: what every comparison runs (a graph, an engine, the
# eager model).
Runner = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]
