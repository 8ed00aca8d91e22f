"""Tokenization, batching and pooling: the runtime's work around the backend call.

Tokenization uses the bundle's own ``tokenizer.json`` through ``tokenizers`` (the Rust tokenizer
transformers' fast tokenizers wrap), truncated like sentence-transformers (``longest_first`` to
the bundle's max length, special tokens counted). The tokenizer is configured once when the
Encoder opens and only read afterwards; ``tokenizers.Tokenizer`` is ``Sync`` in Rust and its
encode calls take it by shared reference, so threads share it without a lock.

Pooling here is the numpy twin of ``mbert.modeling.pooling.Pooling`` (the module inside the
graph), used when pooling must happen outside the graph: prompt tokens excluded
(``include_prompt: false``), the caller overriding normalization, or a bundle without pooling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from mbert.modeling.tokenizer import load_tokenizer

CHARS_PER_TOKEN = 12  # prefix length (per allowed token) at which very long texts are cut before tokenizing
_WHITESPACE = re.compile(r"\s")


@dataclass
class EncodeStats:
    """What one encode/predict/fill_mask call did (``Encoder.last_stats``, per thread)."""

    texts: int = 0
    tokens: int = 0  # real tokens, special tokens included
    padded_tokens: int = 0  # tokens the backend processed (padding included)
    truncated: int = 0  # inputs cut to the max length
    truncated_indices: list[int] = field(default_factory=list)
    batches: int = 0
    tokenize_s: float = 0.0
    batching_s: float = 0.0  # sorting, building padded arrays, restoring order
    backend_s: float = 0.0
    pooling_s: float = 0.0  # pooling / normalization / softmax done in the runtime
    total_s: float = 0.0


class TextEncoder:
    """The bundle's tokenizer, truncating to ``max_len`` (no padding: batches pad themselves)."""

    def __init__(self, path: Path, max_len: int):
        tok = load_tokenizer(path)
        tok.enable_truncation(max_len)  # strategy longest_first, side right: as transformers' defaults
        self.tokenizer, self.max_len = tok, max_len
        self.mask_token_id = tok.token_to_id("[MASK]")
        self._prompt_lengths: dict[str, int] = {}

    def encode(self, inputs: Sequence) -> list:
        """Encodings of ``inputs`` (strings or pairs), truncated; ``enc.overflowing`` is non-empty
        exactly when an input was cut. A single text far longer than the max length is tokenized
        only up to the first whitespace after ``CHARS_PER_TOKEN`` characters per allowed token
        (the pre-tokenizer never joins across whitespace, so the kept tokens are the same); if that
        prefix does not overflow, the whole text is tokenized after all."""
        inputs = list(inputs)
        if not inputs:
            return []
        limit = self.max_len * CHARS_PER_TOKEN
        prepared, cut = [], []
        for i, x in enumerate(inputs):
            if isinstance(x, str) and len(x) > limit:
                m = _WHITESPACE.search(x, limit, limit + 4096)
                if m is not None:
                    x = x[: m.start()]
                    cut.append(i)
            prepared.append(x)
        encodings = self.tokenizer.encode_batch(prepared)
        redo = [i for i in cut if not encodings[i].overflowing]
        for i, enc in zip(redo, self.tokenizer.encode_batch([inputs[i] for i in redo]) if redo else []):
            encodings[i] = enc
        return encodings

    def prompt_length(self, prompt: str, special_ids: set[int]) -> int:
        """Tokens a prompt occupies at the start of an input, [CLS] included: sentence-transformers'
        rule (the prompt tokenized alone, less a trailing special token)."""
        if prompt not in self._prompt_lengths:
            ids = self.tokenizer.encode(prompt).ids
            n = len(ids) - (1 if ids and ids[-1] in special_ids else 0)
            self._prompt_lengths[prompt] = n
        return self._prompt_lengths[prompt]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


MIN_FILL = 0.75  # a row joins a batch only if it fills this share of the batch's padded length ...
SHORT = 64  # ... unless the batch's padded length is at most this (short texts batch freely)


def plan_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int,
                 pad_to: Callable[[int, int], int], max_batch: int | None = None) -> Iterator[list[int]]:
    """Indices grouped into batches: longest first (so the largest batch, and any memory error,
    comes first), each cut by count (``batch_size``, and the backend's ``max_batch``), by padded
    tokens (rows x the batch's padded length <= ``max_batch_tokens``; a longer single row runs alone)
    and by padding waste (a row shorter than ``MIN_FILL`` of the padded length starts a new batch,
    except among texts of at most ``SHORT`` tokens, where per-call overhead outweighs padding)."""
    cap = min(batch_size, max_batch) if max_batch else batch_size
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        if batch:
            n = len(batch) + 1
            padded = pad_to(lengths[batch[0]], n)
            if n > cap or n * padded > max_batch_tokens or (padded > SHORT and lengths[i] < MIN_FILL * padded):
                yield batch
                batch = []
        batch.append(i)
    if batch:
        yield batch


def pool(hidden: np.ndarray, mask: np.ndarray, modes: Sequence[str], normalize: bool) -> np.ndarray:
    """The exporter's own pooling (``mbert.modeling.pooling.Pooling``, the module inside the graph) on
    numpy arrays: [B, T, D], [B, T] 0/1 -> [B, D * len(modes)] float32."""
    import torch

    from mbert.modeling.pooling import Pooling

    with torch.no_grad():
        pooled = Pooling(tuple(modes), normalize)(torch.from_numpy(np.asarray(hidden, dtype=np.float32)),
                                                  torch.from_numpy(np.asarray(mask)))
    return pooled.numpy()


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """``torch.nn.functional.normalize(x, p=2, dim=-1)`` (eps 1e-12), as sentence-transformers' Normalize."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norm, 1e-12)).astype(np.float32, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
