"""Sentence-embedding pooling as sentence-transformers declares it.

Reads ``modules.json``, ``1_Pooling/config.json`` (or whatever path modules.json names),
``sentence_bert_config.json`` and ``config_sentence_transformers.json``. The pooling itself is a
small ``nn.Module`` so it can sit inside the exported ONNX graph (``sentence_embedding``) and the
runtime uses the very same code. Every mode sentence-transformers supports is implemented; modules
other than Transformer / Pooling / Normalize (Dense, LayerNorm, ...) are refused with a clear error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import PoolingError, read_json
from .paths import inside
from .model import MASK_FILL

# sentence-transformers' concatenation order when several modes are enabled
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """What a sentence-transformers checkpoint declares about turning tokens into one vector."""

    modes: tuple[str, ...] = ("cls",)
    normalize: bool = False
    max_seq_length: int | None = None
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def mode(self) -> str:
        return "+".join(self.modes)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise PoolingError(f"pooling modes {list(self.modes)} not supported; expected some of {', '.join(MODES)}")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise PoolingError(f"max_seq_length must be a positive integer, got {self.max_seq_length}")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise PoolingError(f"default_prompt_name {self.default_prompt_name!r} is not one of the prompts")

    def module(self) -> "Pooling":
        return Pooling(self.modes, self.normalize)


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
                out.append(torch.where(mask > 0, hidden, torch.full_like(hidden, MASK_FILL)).amax(dim=1))
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
            else:  # guarded by load_pooling
                raise AssertionError(mode)
        pooled = out[0] if len(out) == 1 else torch.cat(out, dim=-1)  # [B, D']
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled


def load_pooling(source: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers folder declares, or ``None`` when it has no ``modules.json``.

    ``source`` is a local folder or a hub id (resolved like :func:`mbert.modeling.load_model`).
    """
    from .checkpoint import resolve

    root = resolve(source).path
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    if not isinstance(modules, list):
        raise PoolingError(f"{modules_file}: expected a list of modules")
    if not all(isinstance(m, dict) for m in modules):
        raise PoolingError(f"{modules_file}: every module entry must be an object")
    kinds = [m.get("type") for m in modules]
    unsupported = [m for m in modules if m.get("type") not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unsupported:
        names = ", ".join(f"{m.get('type')} ({m.get('path')})" for m in unsupported)
        raise PoolingError(f"{modules_file}: unsupported sentence-transformers module(s): {names}")
    pool_entries = [m for m in modules if m.get("type") == _POOLING]
    if len(pool_entries) != 1:
        raise PoolingError(f"{modules_file}: expected exactly one Pooling module, found {len(pool_entries)}")

    sub = pool_entries[0].get("path", "1_Pooling")
    pool_file = inside(root, f"{sub}/config.json", f"{modules_file}: Pooling module 'path'", PoolingError)
    raw = _read(pool_file)
    modes = _modes(raw, pool_file)

    max_len = None
    sbert = root / "sentence_bert_config.json"
    if sbert.is_file():
        max_len = _read(sbert).get("max_seq_length")
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise PoolingError(f"{sbert}: key 'max_seq_length' must be a positive integer, got {max_len!r}")

    prompts: dict[str, str] = {}
    default_prompt = None
    st_cfg = root / "config_sentence_transformers.json"
    if st_cfg.is_file():
        raw_st = _read(st_cfg)
        prompts = raw_st.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise PoolingError(f"{st_cfg}: key 'prompts' must map names to strings")
        default_prompt = raw_st.get("default_prompt_name")
        if default_prompt is not None and default_prompt not in prompts:
            raise PoolingError(f"{st_cfg}: key 'default_prompt_name' {default_prompt!r} is not in 'prompts'")

    return PoolingConfig(
        modes=modes,
        normalize=_NORMALIZE in kinds,
        max_seq_length=max_len,
        include_prompt=bool(raw.get("include_prompt", True)),
        prompts=dict(prompts),
        default_prompt_name=default_prompt,
    )


def _modes(raw: dict[str, Any], path: Path) -> tuple[str, ...]:
    if "pooling_mode" in raw:  # sentence-transformers >= 5 writes one key
        value = raw["pooling_mode"]
        modes = (value,) if isinstance(value, str) else tuple(value)
    else:
        modes = tuple(mode for key, mode in _LEGACY_KEYS.items() if raw.get(key, False))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise PoolingError(f"{path}: pooling mode {bad or 'none'} not supported; expected one of {', '.join(MODES)}")
    return modes


def _read(path: Path) -> Any:
    return read_json(path, PoolingError)
