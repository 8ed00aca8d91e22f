"""Sentence-embedding pooling as a small ``nn.Module``, so it sits inside the exported ONNX graph
(``sentence_embedding``); the declaration it computes is :class:`mbert.bundle.pooling.PoolingConfig`."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mbert.bundle.pooling import MAX_FILL, PoolingConfig, read_pooling


class Pooling(nn.Module):
    """``forward(hidden [B, T, D], attention_mask [B, T]) -> [B, D * len(modes)]``.

    ``attention_mask`` may have prompt positions zeroed (``include_prompt: false``); the mask is
    assumed right-padded, as the tokenizers here produce it. Traceable: no data-dependent branches.
    """

    def __init__(self, modes: tuple[str, ...], normalize: bool):
        super().__init__()
        self.modes, self.normalize = tuple(modes), normalize

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        mask = attention_mask.to(torch.float32).unsqueeze(-1)  # [B, T, 1]
        count = mask.sum(dim=1).clamp(min=1e-9)  # [B, 1]
        out = []
        for mode in self.modes:
            if mode == "cls":  # first token the mask keeps (index 0 without an excluded prompt)
                first = attention_mask.to(torch.int32).argmax(dim=1)  # [B]
                out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
            elif mode == "max":
                out.append(torch.where(mask > 0, hidden, torch.full_like(hidden, MAX_FILL)).amax(dim=1))
            elif mode == "mean":
                out.append((hidden * mask).sum(dim=1) / count)
            elif mode == "mean_sqrt_len_tokens":
                out.append((hidden * mask).sum(dim=1) / count.sqrt())
            elif mode == "weightedmean":
                w = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=torch.float32)
                wm = mask * w.view(1, -1, 1)
                out.append((hidden * wm).sum(dim=1) / wm.sum(dim=1).clamp(min=1e-9))
            elif mode == "lasttoken":
                last = (attention_mask.to(torch.int64).sum(dim=1) - 1).clamp(min=0)
                out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
            else:  # guarded by PoolingConfig
                raise AssertionError(mode)
        pooled = out[0] if len(out) == 1 else torch.cat(out, dim=-1)  # [B, D']
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled

    @classmethod
    def of(cls, config: PoolingConfig) -> "Pooling":
        return cls(config.modes, config.normalize)


def load_pooling(source: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers checkpoint declares, or ``None`` when it has no
    ``modules.json``. ``source`` is a local folder or a hub id (resolved like
    :func:`mbert.modeling.load_model`)."""
    from mbert.modeling.checkpoint import resolve

    return read_pooling(resolve(source).path)
