"""The module an exported graph computes: the eager model, then pooling, with the outputs the
contract (:func:`mbert.bundle.tensors.output_specs`) names; and the eager FP32 runner."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mbert.bundle.pooling import PoolingConfig
from mbert.bundle.tensors import Runner, TensorSpec, output_specs
from mbert.modeling.pooling import Pooling


class GraphModule(nn.Module):
    """What an exported graph computes: the eager model, then pooling (encoder bundles with a
    sentence-transformers pooling); outputs are FP32, named by :func:`output_specs`."""

    def __init__(self, model: nn.Module, pooling: PoolingConfig | None):
        super().__init__()
        self.model = model
        self.task = model.config.task
        self.pooling = Pooling.of(pooling) if pooling is not None and self.task == "encoder" else None

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
