"""The output contract of an exported graph, and the module that computes it.

One table (:func:`output_specs`) says which outputs a bundle of a given task and pooling has, with
their dtypes and shapes. :class:`GraphModule` (what ``mbert.export.onnx.to_onnx`` traces), the
runtime's checks of a bundle and the Triton repository writer all read it, so the three cannot
disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from .pooling import PoolingConfig

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


class GraphModule(nn.Module):
    """What an exported graph computes: the eager model, then pooling (encoder bundles with a
    sentence-transformers pooling); outputs are FP32, named by :func:`output_specs`."""

    def __init__(self, model: nn.Module, pooling: PoolingConfig | None):
        super().__init__()
        self.model = model
        self.task = model.config.task
        self.pooling = pooling.module() if pooling is not None and self.task == "encoder" else None

    def output_specs(self) -> tuple[TensorSpec, ...]:
        cfg = self.model.config
        return output_specs(self.task, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                            num_labels=cfg.num_labels, pooling_modes=self.pooling.modes if self.pooling else None)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.output_specs())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.model(input_ids, attention_mask).float()  # [B, T, D] or logits
        if self.pooling is None:
            return out
        return out, self.pooling(out, attention_mask)  # [B, T, D], [B, D']


Runner = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


def eager_runner(graph: GraphModule) -> Runner:
    """``ids, mask -> {output name: float32 array}`` running ``graph`` (the FP32 reference)."""
    device = next(graph.parameters()).device
    names = graph.output_names

    @torch.inference_mode()
    def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        out = graph(torch.from_numpy(np.ascontiguousarray(ids)).to(device),
                    torch.from_numpy(np.ascontiguousarray(mask)).to(device))
        out = out if isinstance(out, tuple) else (out,)
        return {n: o.float().cpu().numpy() for n, o in zip(names, out)}

    return run
