"""Tokenization, padding, batching and pooling: the runtime's work around the backend call.

Tokenization uses the bundle's own ``tokenizer.json`` through ``tokenizers`` (the Rust tokenizer
transformers' fast tokenizers wrap), truncated like sentence-transformers (``longest_first`` to
the bundle's max length, special tokens counted). The tokenizer is configured once when the
Encoder opens and only read afterwards; ``tokenizers.Tokenizer`` is ``Sync`` in Rust and its
encode calls take it by shared reference, so threads share it without a lock.

Pooling here is the numpy twin of ``mbert.modeling.pooling.Pooling`` (the module inside the
graph; the runtime imports no torch), used when pooling must happen outside the graph: prompt tokens excluded
(``include_prompt: false``), the caller overriding normalization, or a bundle without pooling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mbert.bundle.errors import EngineError
from mbert.bundle.pooling import MAX_FILL, MODES
from mbert.bundle.tokenizer import load_tokenizer

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
    lengths: list[int] = field(default_factory=list)  # tokens of each input, in input order (after truncation)
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


# --- padding: the one rule of every backend ----------------------------------------------------------

PAD_MULTIPLE = 8


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def padded_length(seq: int, batch: int, max_seq: int, profiles: Sequence[Any] | None = None) -> int:
    """Length to pad a batch whose longest row has ``seq`` tokens: ``seq`` rounded up to a multiple of
    8, capped at ``max_seq``; with TensorRT profiles, the smallest such length some profile covering
    ``batch`` accepts (raised to the profile's minimum, capped at its maximum)."""
    if not profiles:
        return max(seq, min(round_up(seq), max_seq))
    best = None
    for p in profiles:
        if not p.min[0] <= batch <= p.max[0] or seq > p.max[1]:
            continue
        length = min(max(round_up(seq), p.min[1]), p.max[1])
        best = length if best is None else min(best, length)
    if best is None:
        listed = "; ".join(str(p) for p in profiles)
        raise EngineError(f"no optimization profile accepts batch {batch} x {seq} tokens (profiles: {listed})")
    return best


class Padding:
    """``pad_to`` and ``max_batch`` of a backend with ``max_seq`` and optional ``profiles``."""

    max_seq: int
    profiles: list | None = None

    @property
    def max_batch(self) -> int | None:
        return max(p.max[0] for p in self.profiles) if self.profiles else None

    def pad_to(self, seq: int, batch: int = 1) -> int:
        return padded_length(seq, batch, self.max_seq, self.profiles)


# --- batching --------------------------------------------------------------------------------------

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
    """The graph's pooling (``mbert.modeling.pooling.Pooling``) on numpy arrays, in float32:
    [B, T, D], [B, T] 0/1 (right-padded; prompt positions may be zeroed) -> [B, D * len(modes)].
    ``tests/test_runtime.py`` checks it equal to the module for every mode."""
    hidden = np.asarray(hidden, dtype=np.float32)
    keep = np.asarray(mask) != 0
    m = keep.astype(np.float32)[..., None]  # [B, T, 1]
    count = np.maximum(m.sum(axis=1), np.float32(1e-9))  # [B, 1]
    rows = np.arange(hidden.shape[0])
    out = []
    for mode in modes:
        if mode == "cls":  # first token the mask keeps (index 0 without an excluded prompt)
            out.append(hidden[rows, keep.argmax(axis=1)])
        elif mode == "max":
            out.append(np.where(m > 0, hidden, np.float32(MAX_FILL)).max(axis=1))
        elif mode == "mean":
            out.append((hidden * m).sum(axis=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            out.append((hidden * m).sum(axis=1) / np.sqrt(count))
        elif mode == "weightedmean":
            wm = m * np.arange(1, hidden.shape[1] + 1, dtype=np.float32)[None, :, None]
            out.append((hidden * wm).sum(axis=1) / np.maximum(wm.sum(axis=1), np.float32(1e-9)))
        elif mode == "lasttoken":
            out.append(hidden[rows, np.maximum(keep.sum(axis=1) - 1, 0)])
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(MODES)}")
    pooled = out[0] if len(out) == 1 else np.concatenate(out, axis=-1)
    return l2_normalize(pooled) if normalize else pooled.astype(np.float32, copy=False)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """``torch.nn.functional.normalize(x, p=2, dim=-1)`` (eps 1e-12), as sentence-transformers' Normalize."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norm, 1e-12)).astype(np.float32, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
