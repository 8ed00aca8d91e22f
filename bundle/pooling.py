"""Sentence-embedding pooling as sentence-transformers declares it: the declaration, read from a
checkpoint or bundle folder, with no torch.

Reads ``modules.json``, ``1_Pooling/config.json`` (or whatever path modules.json names),
``sentence_bert_config.json`` and ``config_sentence_transformers.json``. The pooling itself is
computed by ``mbert.modeling.pooling.Pooling`` inside the exported graph and by its numpy twin
``mbert.runtime.text.pool`` outside it. Every mode sentence-transformers supports is implemented;
modules other than Transformer / Pooling / Normalize (Dense, LayerNorm, ...) are refused with a
clear error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbert.bundle.errors import PoolingError
from mbert.bundle.files import read_json
from mbert.bundle.names import CONFIG, ST_CONFIG, ST_MODEL_CONFIG, ST_MODULES
from mbert.bundle.paths import inside

# What max pooling gives padded positions: the most negative finite float16, so an FP16 graph pools
# as the FP32 one does.
MAX_FILL = -65504.0
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


def read_pooling(root: Path) -> PoolingConfig | None:
    """The pooling the sentence-transformers folder ``root`` declares, or ``None`` when it has no
    ``modules.json``."""
    root = Path(root)
    modules_file = root / ST_MODULES
    if not os.path.lexists(modules_file):  # a dangling link or a FIFO is an error below, not 'no pooling'
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
    pool_file = inside(root, f"{sub}/{CONFIG}", f"{modules_file}: Pooling module 'path'", PoolingError)
    raw = _read(pool_file)
    modes = _modes(raw, pool_file)

    max_len = None
    sbert = root / ST_CONFIG
    if os.path.lexists(sbert):
        max_len = _read(sbert).get("max_seq_length")
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise PoolingError(f"{sbert}: key 'max_seq_length' must be a positive integer, got {max_len!r}")

    prompts: dict[str, str] = {}
    default_prompt = None
    st_cfg = root / ST_MODEL_CONFIG
    if os.path.lexists(st_cfg):
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
