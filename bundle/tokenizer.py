"""The checkpoint's tokenizer: loaded once, checked against the model, and the one padding rule.

Everything that tokenizes (export validation, the FP16 scan, the runtime) opens ``tokenizer.json``
through :func:`load_tokenizer` and pads with :func:`pad_batch`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import TokenizerError
from mbert.bundle.files import TOKENIZER_LIMIT, read_bounded
from mbert.bundle.names import TOKENIZER


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` (or a folder holding it), with no padding
    and no truncation configured; TokenizerError naming the file when it is missing or unreadable."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER
    if not os.path.lexists(path):
        raise TokenizerError(f"{path}: tokenizer.json not found (the tokenizer is needed to validate and serve "
                             "on real text)")
    data = read_bounded(path, TOKENIZER_LIMIT, TokenizerError)
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
        raise TokenizerError(f"{path}: unreadable tokenizer ({exc})") from exc
    tok.no_padding()
    tok.no_truncation()
    return tok


def check_token_ids(cfg: ModernBertConfig, tokenizer, tokenizer_path: str | Path) -> None:
    """Every id the model can be fed must index its embedding table (``vocab_size`` rows): the special
    tokens of config.json and every id of the tokenizer. TokenizerError / ConfigError naming the file."""
    from mbert.bundle.errors import ConfigError

    vocab = cfg.vocab_size
    for key in ("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, key)
        if value is not None and not 0 <= value < vocab:
            raise ConfigError(f"{cfg.source}: key {key!r} is {value}, outside the embedding table "
                              f"(vocab_size {vocab})")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    biggest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if biggest >= vocab:
        token = tokenizer.id_to_token(biggest)
        raise TokenizerError(f"{tokenizer_path}: token {token!r} has id {biggest}, outside the model's embedding "
                             f"table (vocab_size {vocab} in {cfg.source}); {size} ids in the tokenizer")


def pad_batch(rows: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 ids and attention mask of shape [len(rows), length]."""
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
        mask[r, : len(row)] = 1
    return ids, mask
