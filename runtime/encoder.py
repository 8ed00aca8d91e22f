"""``Encoder``: a verified bundle, a backend, and the work around it (tokenization, prompts,
truncation accounting, length-sorted token-budget batching, pooling, order restoration).

Normalization contract of :meth:`Encoder.encode`: by default vectors are L2-normalized exactly when
the checkpoint declares a ``Normalize`` module (sentence-transformers' behaviour; gte-modernbert-base
declares none and its vectors have norms ~37-39). ``normalize=True`` / ``False`` overrides it; when
the graph already normalizes and the caller asks for ``False``, pooling is redone in the runtime from
``last_hidden_state`` (not "un-normalized", which is impossible).
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mbert.bundle import Bundle, open_bundle
from mbert.bundle.errors import OptionError
from mbert.bundle.names import TOKENIZER
from mbert.bundle.tokenizer import pad_batch
from mbert.runtime.backends import Backend, open_backend
from mbert.runtime.text import EncodeStats, TextEncoder, l2_normalize, plan_batches, pool, softmax

log = logging.getLogger("mbert.runtime")
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_BATCH_TOKENS = 16384  # padded tokens per batch
MLM_MAX_BATCH_TOKENS = 1024  # masked-LM logits are [B, T, vocab]: 1024 x 50368 floats is ~200 MB


class Encoder:
    """Run a bundle: ``encode`` (embedding bundles), ``predict`` (classification), ``fill_mask`` (masked LM).

    Safe to share between threads: concurrent calls return the same results as sequential ones
    (ONNX Runtime and eager calls run concurrently, TensorRT calls are serialized by a lock, the
    tokenizer is read-only after opening, per-call statistics are per thread).
    """

    def __init__(self, bundle: Bundle, backend: Backend, *, batch_size: int = DEFAULT_BATCH_SIZE,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, progress: bool = False, source=None):
        self.batch_size = _positive("batch_size", batch_size)
        self.max_batch_tokens = _positive("max_batch_tokens", max_batch_tokens)
        self.bundle, self.backend = bundle, backend
        self.path, self.manifest = bundle.path, bundle.manifest
        self.task: str = self.manifest.task
        self.pooling = self.manifest.pooling
        limits = [self.manifest.max_seq_len] + ([self.pooling.max_seq_length] if self.pooling and self.pooling.max_seq_length else [])
        self.max_length: int = min(limits)
        self.progress, self.source = bool(progress), source
        m = self.manifest.model
        self.hidden_size: int = m.hidden_size
        self.pad_id: int = m.pad_token_id
        self._special = {i for i in (m.cls_token_id, m.sep_token_id, m.pad_token_id) if i is not None}
        self.labels = {int(k): v for k, v in (self.manifest.labels or {}).items()}
        self.text = TextEncoder(bundle.path_of(TOKENIZER), self.max_length)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._warned_truncation = self._warned_pooling = False

    @classmethod
    def from_bundle(cls, path: str | Path, backend: str = "auto", device: str | None = None,
                    precision: str | None = None, *, batch_size: int = DEFAULT_BATCH_SIZE,
                    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, progress: bool = False,
                    threads: int | None = None, source: str | Path | None = None, verify: bool = True) -> "Encoder":
        """Open a bundle folder; refuses one whose files, manifest or engine do not match (BundleError).

        ``backend``: ``auto`` (TensorRT, then ONNX Runtime CUDA, then ONNX Runtime CPU), ``tensorrt``,
        ``onnxruntime`` (``-cuda`` / ``-cpu``) or ``eager`` (PyTorch on the source checkpoint, which
        ``source`` may point to). ``device``: ``cpu``, ``cuda`` or ``cuda:N``. ``precision``: ``fp32``,
        ``fp16`` (ONNX Runtime's default is FP16 on CUDA when the bundle has it, FP32 on CPU) or ``int8``
        (``model.int8.onnx`` of an ``--int8`` export, on ONNX Runtime CPU only).
        ``auto`` uses the TensorRT plan only where its family's rules let it run here; asked for by
        name, a plan that cannot run here is refused (BundleError saying why): rebuild it, or pass
        ``backend="onnxruntime"``. A plan exported "built, not yet run" runs the parity grid on its
        first open on a GPU and is refused if it fails (:mod:`mbert.runtime.backends.verdicts`).
        ``verify=False`` skips hashing the files (the manifest is still cross-checked).
        """
        bundle = open_bundle(path, verify=verify)
        try:
            with bundle.naming():
                b = open_backend(bundle, backend, device, precision, threads=threads, source=source)
                return cls(bundle, b, batch_size=batch_size, max_batch_tokens=max_batch_tokens, progress=progress,
                           source=source)
        except BaseException:
            bundle.close()
            raise

    # --- properties --------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def precision(self) -> str:
        return self.backend.precision

    @property
    def dimension(self) -> int:
        """Length of a sentence vector (hidden size x number of pooling modes)."""
        return self.hidden_size * (len(self.pooling.modes) if self.pooling else 1)

    @property
    def last_stats(self) -> EncodeStats:
        """Statistics of this thread's last call (truncated inputs, tokens, time split)."""
        return getattr(self._local, "stats", None) or EncodeStats()

    def __repr__(self) -> str:
        return f"Encoder({str(self.path)!r}, task={self.task!r}, backend={self.backend_name!r}, precision={self.precision!r})"

    # --- encode ------------------------------------------------------------------------------
    def encode(self, texts: str | Sequence[str], *, normalize: bool | None = None, batch_size: int | None = None,
               output: str = "sentence", prompt_name: str | None = None, prompt: str | None = None,
               max_batch_tokens: int | None = None, show_progress: bool | None = None):
        """Embed texts, in the caller's order.

        ``output="sentence"``: float32 array [N, dimension] (a [dimension] vector for a single string),
        pooled as the checkpoint declares, normalized as it declares unless ``normalize`` overrides
        (see the module docstring). ``output="tokens"``: a list of float32 [len_i, hidden] arrays
        (special tokens included, padding excluded; ``normalize`` does not apply).
        ``prompt`` (a string) or ``prompt_name`` (a key of config_sentence_transformers.json's
        prompts) is prepended to every text; without either the declared default prompt is used.
        """
        if self.task != "encoder":
            raise OptionError(f"encode needs an embedding (encoder) bundle; this one is {self.task!r}: use "
                             + ("fill_mask()" if self.task == "masked-lm" else "predict()"))
        if output not in ("sentence", "tokens"):
            raise OptionError(f"output must be 'sentence' or 'tokens', got {output!r}")
        if normalize is not None and not isinstance(normalize, bool):
            raise TypeError(f"normalize must be True, False or None (as the checkpoint declares), got {normalize!r}")
        single, items = _check_inputs(texts, pairs=False)
        prompt = self._resolve_prompt(prompt, prompt_name)
        norm = bool(normalize) if normalize is not None else bool(self.pooling and self.pooling.normalize)
        excluded = 0
        if prompt and self.pooling is not None and not self.pooling.include_prompt:
            excluded = self.text.prompt_length(prompt, self._special)
        if self.pooling is None and output == "sentence":
            self._warn_no_pooling()
        modes = self.pooling.modes if self.pooling else ("mean",)
        in_graph = (output == "sentence" and self.pooling is not None and not excluded
                    and not (self.pooling.normalize and not norm))
        post_norm = in_graph and norm and not self.pooling.normalize
        stats = EncodeStats()
        start = time.perf_counter()
        encodings = self._tokenize([prompt + t for t in items] if prompt else items, stats)
        n = len(items)
        if output == "tokens":
            result: Any = [None] * n
        else:
            result = np.zeros((n, self.dimension), dtype=np.float32)

        def consume(idx: list[int], out: dict, mask: np.ndarray) -> None:
            if output == "tokens":
                hidden = out["last_hidden_state"]
                for r, i in enumerate(idx):
                    result[i] = np.array(hidden[r, : len(encodings[i].ids)], dtype=np.float32)
                return
            if in_graph:
                vec = out["sentence_embedding"]
                result[idx] = l2_normalize(vec) if post_norm else vec
                return
            pm = mask
            if excluded:
                pm = mask.copy()
                pm[:, :excluded] = 0  # as sentence-transformers: prompt tokens ([CLS] included) leave pooling
            result[idx] = pool(out["last_hidden_state"], pm, modes, norm)

        want = ["sentence_embedding"] if in_graph else ["last_hidden_state"]
        self._forward(encodings, want, consume, stats, batch_size, max_batch_tokens, show_progress)
        self._finish(stats, start)
        if single:
            return result[0]
        return result

    # --- heads ---------------------------------------------------------------------------------
    def predict(self, inputs, *, batch_size: int | None = None, show_progress: bool | None = None) -> list:
        """Classification bundles. Sequence classification: one ``{"label", "score", "scores"}`` per input
        (softmax over the labels; ``scores`` maps every label to its probability); inputs are strings or
        ``(text, text_pair)`` pairs. Token classification: per input, a list of
        ``{"index", "token", "text", "start", "end", "label", "score"}`` for every non-special token."""
        if self.task not in ("sequence-classification", "token-classification"):
            raise OptionError(f"predict needs a classification bundle; this one is {self.task!r}: use "
                             + ("fill_mask()" if self.task == "masked-lm" else "encode()"))
        token_level = self.task == "token-classification"
        single, items = _check_inputs(inputs, pairs=not token_level)
        stats, start = EncodeStats(), time.perf_counter()
        encodings = self._tokenize([tuple(x) if isinstance(x, list) else x for x in items], stats)
        result: list = [None] * len(items)
        names = [self.labels.get(i, f"LABEL_{i}") for i in range(len(self.labels))]

        def consume(idx, out, mask):
            probs = softmax(out["logits"])
            for r, i in enumerate(idx):
                if not token_level:
                    k = int(probs[r].argmax())
                    result[i] = {"label": names[k], "score": float(probs[r, k]),
                                 "scores": {names[j]: float(p) for j, p in enumerate(probs[r])}}
                    continue
                enc, text, rows = encodings[i], items[i], []
                for t, (special, tok, (s, e)) in enumerate(zip(enc.special_tokens_mask, enc.tokens, enc.offsets)):
                    if special:
                        continue
                    k = int(probs[r, t].argmax())
                    rows.append({"index": t, "token": tok, "text": text[s:e], "start": s, "end": e,
                                 "label": names[k], "score": float(probs[r, t, k])})
                result[i] = rows

        self._forward(encodings, ["logits"], consume, stats, batch_size, None, show_progress)
        self._finish(stats, start)
        return result[0] if single else result

    def fill_mask(self, text: str | Sequence[str], top_k: int = 5, *, batch_size: int | None = None):
        """Masked-LM bundles: the ``top_k`` fillers of each ``[MASK]``, like transformers' fill-mask
        pipeline: ``[{"score", "token", "token_str", "sequence"}, ...]`` for a text with one mask (a
        list of such lists for several masks; a list of results for a list of texts)."""
        if self.task != "masked-lm":
            raise OptionError(f"fill_mask needs a masked-LM bundle; this one is {self.task!r}")
        if self.text.mask_token_id is None:
            raise OptionError(f"{self.path / TOKENIZER} has no [MASK] token")
        if not isinstance(top_k, int) or top_k < 1:
            raise OptionError(f"top_k must be a positive int, got {top_k!r}")
        single, items = _check_inputs(text, pairs=False)
        stats, start = EncodeStats(), time.perf_counter()
        encodings = self._tokenize(items, stats)
        mask_id = self.text.mask_token_id
        positions = []
        for i, enc in enumerate(encodings):
            pos = [p for p, t in enumerate(enc.ids) if t == mask_id]
            if not pos:
                cut = " (after truncation to the max length)" if i in stats.truncated_indices else ""
                raise OptionError(f"text[{i}] has no [MASK] token{cut}")
            positions.append(pos)
        result: list = [None] * len(items)

        def consume(idx, out, mask):
            for r, i in enumerate(idx):
                ids = list(encodings[i].ids)
                per_mask = []
                for p in positions[i]:
                    probs = softmax(out["logits"][r, p])
                    k = min(top_k, probs.shape[-1])
                    best = np.argpartition(-probs, k - 1)[:k]
                    best = best[np.argsort(-probs[best], kind="stable")]
                    rows = []
                    for tok in best.tolist():
                        filled = ids.copy()
                        filled[p] = tok
                        rows.append({"score": float(probs[tok]), "token": int(tok),
                                     "token_str": self.text.decode([tok], skip_special_tokens=False),
                                     "sequence": self.text.decode(filled, skip_special_tokens=len(positions[i]) == 1)})
                    per_mask.append(rows)
                result[i] = per_mask[0] if len(per_mask) == 1 else per_mask

        self._forward(encodings, ["logits"], consume, stats, batch_size,
                      min(self.max_batch_tokens, MLM_MAX_BATCH_TOKENS), False)
        self._finish(stats, start)
        return result[0] if single else result

    # --- parity --------------------------------------------------------------------------------
    def check_parity(self, texts: Sequence[str] | None = None, *, max_len: int = 1024, source=None):
        """Run this Encoder's backend and the eager PyTorch model on the same real-text cases (the
        built-in set by default, over ``default_grid`` capped at ``max_len`` tokens); returns the
        export's ``ValidationReport``, judged by the export's stated tolerance for this precision."""
        from mbert.bundle.tokenizer import load_tokenizer
        from mbert.bundle.validation import compare, grid_cases, tolerances_for
        from mbert.runtime.eager import eager_reference

        _positive("max_len", max_len)
        if self.backend.name == "eager" and source is None:
            reference = self.backend.run
        else:
            reference = eager_reference(self.bundle, source or self.source)
        cap = max(1, min(self.manifest.max_seq_len, max_len))
        texts = _check_inputs(texts, pairs=False)[1] if texts is not None else None
        cases = grid_cases(load_tokenizer(self.bundle.path_of(TOKENIZER)), self.manifest.model, cap, texts)

        def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
            B, T = ids.shape
            L = self.backend.pad_to(T, B)
            if L != T:
                ids = np.pad(ids, ((0, 0), (0, L - T)), constant_values=self.pad_id)
                mask = np.pad(mask, ((0, 0), (0, L - T)))
            return {k: (v[:, :T] if v.ndim == 3 else v) for k, v in self.backend.run(ids, mask).items()}

        tol = tolerances_for(self.precision, self.backend.output_names)
        return compare(f"{self.backend.artifact} on {self.backend_name}", run, reference, cases, tol)

    # --- internals -------------------------------------------------------------------------------
    def _resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str:
        prompts = self.pooling.prompts if self.pooling else {}
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            return prompt
        if prompt_name is not None:
            if prompt_name not in prompts:
                known = ", ".join(sorted(prompts)) or "none"
                raise OptionError(f"prompt_name {prompt_name!r} is not one of this bundle's prompts ({known}; "
                                 "from config_sentence_transformers.json)")
            return prompts[prompt_name]
        default = self.pooling.default_prompt_name if self.pooling else None
        return prompts.get(default, "") if default else ""

    def _tokenize(self, inputs: list, stats: EncodeStats) -> list:
        t0 = time.perf_counter()
        encodings = self.text.encode(inputs)
        stats.tokenize_s += time.perf_counter() - t0
        stats.texts = len(inputs)
        stats.lengths = [len(e.ids) for e in encodings]
        stats.tokens = sum(stats.lengths)
        stats.truncated_indices = [i for i, e in enumerate(encodings) if e.overflowing]
        stats.truncated = len(stats.truncated_indices)
        if stats.truncated:
            log.info("mbert.runtime: %d of %d inputs truncated to %d tokens", stats.truncated, len(inputs), self.max_length)
            with self._lock:
                first, self._warned_truncation = not self._warned_truncation, True
            if first:
                warnings.warn(f"{stats.truncated} of {len(inputs)} inputs are longer than {self.max_length} tokens "
                              f"and were truncated (Encoder.last_stats.truncated counts them on every call; this "
                              f"warning is shown once per Encoder)", UserWarning, stacklevel=4)
        return encodings

    def _warn_no_pooling(self) -> None:
        with self._lock:
            first, self._warned_pooling = not self._warned_pooling, True
        if first:
            warnings.warn(f"{self.path} declares no sentence-transformers pooling; using mean pooling without "
                          "normalization, as sentence-transformers does for a plain checkpoint", UserWarning, stacklevel=4)

    def _forward(self, encodings: list, outputs: list[str], consume: Callable, stats: EncodeStats,
                 batch_size: int | None, max_batch_tokens: int | None, show_progress: bool | None) -> None:
        t0 = time.perf_counter()
        lengths = [len(e.ids) for e in encodings]
        batch_size = self.batch_size if batch_size is None else _positive("batch_size", batch_size)
        max_batch_tokens = self.max_batch_tokens if max_batch_tokens is None else _positive("max_batch_tokens",
                                                                                           max_batch_tokens)
        batches = list(plan_batches(lengths, batch_size, max_batch_tokens, self.backend.pad_to, self.backend.max_batch))
        stats.batching_s += time.perf_counter() - t0
        bar = _progress(len(encodings), self.progress if show_progress is None else show_progress)
        try:
            for idx in batches:
                t0 = time.perf_counter()
                length = self.backend.pad_to(lengths[idx[0]], len(idx))
                ids, mask = pad_batch([encodings[i].ids for i in idx], length, self.pad_id)
                t1 = time.perf_counter()
                out = self.backend.run(ids, mask, outputs)
                t2 = time.perf_counter()
                consume(idx, out, mask)
                t3 = time.perf_counter()
                stats.batching_s += t1 - t0
                stats.backend_s += t2 - t1
                stats.pooling_s += t3 - t2
                stats.padded_tokens += ids.size
                stats.batches += 1
                if bar is not None:
                    bar.update(len(idx))
        finally:
            if bar is not None:
                bar.close()

    def _finish(self, stats: EncodeStats, start: float) -> None:
        stats.total_s = time.perf_counter() - start
        self._local.stats = stats


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive integer, got {value!r}")
    return value


_UNORDERED = (set, frozenset, dict, type({}.keys()), type({}.values()), type({}.items()))


def _check_inputs(texts, pairs: bool) -> tuple[bool, list]:
    """(single?, list of inputs). Inputs come as a str (a pair of str where ``pairs``) or an ordered
    collection of them (list, tuple, any sequence or iterator): results follow that order, so an
    unordered collection (a set, a dict) is refused. TypeError / ValueError naming the index of the
    first input that is not valid text (not a str, or not encodable as UTF-8: a lone surrogate)."""
    if isinstance(texts, str):
        return True, [_valid_text(texts, "text")]
    if pairs and isinstance(texts, tuple) and len(texts) == 2 and all(isinstance(t, str) for t in texts):
        return True, [tuple(_valid_text(t, f"text[{i}]") for i, t in enumerate(texts))]
    if isinstance(texts, _UNORDERED):
        raise TypeError(f"texts is a {type(texts).__name__}, which has no order; pass a list (results follow "
                        "the order of the input)")
    if isinstance(texts, (bytes, bytearray)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"expected a string or a list of strings, got {type(texts).__name__}")
    items = list(texts)
    for i, t in enumerate(items):
        if isinstance(t, str):
            _valid_text(t, f"texts[{i}]")
            continue
        if pairs and isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            for j, x in enumerate(t):
                _valid_text(x, f"texts[{i}][{j}]")
            continue
        want = "a str or a (text, text_pair) pair of str" if pairs else "a str"
        raise TypeError(f"texts[{i}] is {type(t).__name__} ({t!r:.40}), expected {want}")
    return False, items


def _valid_text(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OptionError(f"{where} is not valid Unicode text: {exc.reason} at position {exc.start} "
                         f"({text[max(0, exc.start - 10):exc.start]!r} before it)") from None
    return text


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="text", desc="encode", leave=False)
