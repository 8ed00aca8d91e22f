"""The code of the Triton Python-backend models of a bundle's repository (``mbert.export.triton.writer``
writes ``model.py`` files that import :class:`TritonPythonModel` from here).

Two roles, chosen by the model's ``role`` parameter in ``config.pbtxt``:

* ``tokenizer``: TEXT [batch, 1] (UTF-8 bytes) -> ``input_ids``, ``attention_mask`` [batch, length],
  ``num_tokens`` [batch, 1] and ``truncated`` [batch, 1]. Tokenizes with the runtime's own
  :class:`~mbert.runtime.text.TextEncoder`, so texts are truncated exactly as ``Encoder.encode``
  truncates them (to the ``max_length`` parameter, special tokens counted). Each request is padded
  to the smallest of the ``length_buckets`` holding its longest text, so requests of different
  lengths share a shape (and a batch, in the ONNX Runtime / TensorRT models' batchers).
  Truncated texts are counted on Triton's metrics endpoint as ``mbert_truncated_texts_total``
  (label ``model``). A text that is not UTF-8 fails its request (INVALID_ARG, the message names the
  row); an empty text is embedded like any other, as the runtime embeds it.
* ``encoder``: ``input_ids``, ``attention_mask`` -> the graph's outputs, with ONNX Runtime on CPU.
  Its inputs allow ragged batches: Triton's dynamic batcher hands over every queued request, of any
  length; the rows of all of them are stripped of padding and re-batched with the runtime's
  length-sorted token-budget batching (:func:`~mbert.runtime.text.plan_batches`: ``batch_size``
  rows, ``max_batch_tokens`` padded tokens, padded as ``Encoder`` pads), and the results scattered
  back. Per-token outputs (first non-batch axis ``-1``) come back at the request's padded length,
  zero past each row's tokens. Only the outputs a request asks for are computed.

Everything Triton-specific (``triton_python_backend_utils``) is imported inside ``initialize``: it
only exists in Triton's Python backend.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np

from mbert.bundle.names import TOKENIZER
from mbert.bundle.tokenizer import pad_batch
from mbert.runtime.text import plan_batches

TRUNCATED_METRIC = "mbert_truncated_texts_total"


class TritonPythonModel:
    """Triton's entry points; delegates to :class:`TokenizerModel` or :class:`EncoderModel`."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        config = json.loads(args["model_config"])
        role = parameters(config).get("role")
        roles = {"tokenizer": TokenizerModel, "encoder": EncoderModel}
        if role not in roles:
            raise ValueError(f"{config.get('name')}/config.pbtxt: parameter role is {role!r}, "
                             f"expected one of {sorted(roles)}")
        folder = Path(args["model_repository"]) / args["model_version"]
        self.impl = roles[role](config, folder, pb_utils)

    def execute(self, requests: list[Any]) -> list[Any]:
        return self.impl.execute(requests)

    def finalize(self) -> None:
        self.impl = None


def parameters(config: dict) -> dict[str, str]:
    """``parameters`` of a model config (as Triton passes it, JSON) as a plain dict."""
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


class _Role:
    """What both roles read from their config: parameters, ``max_length`` and ``pad_id``."""

    def __init__(self, config: dict, pb_utils: Any):
        self.name, self.params, self.pb = config.get("name"), parameters(config), pb_utils
        self.max_length = self.integer("max_length")
        self.pad_id = self.integer("pad_id")

    def integer(self, key: str) -> int:
        try:
            return int(self.params[key])
        except (KeyError, ValueError):
            raise ValueError(f"{self.name}/config.pbtxt: parameter {key} must be an integer, "
                             f"got {self.params.get(key)!r}") from None


def _bad_request(pb_utils: Any, message: str) -> Any:
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def decode_texts(array: np.ndarray) -> list[str]:
    """TYPE_STRING tensor [batch, 1] of bytes -> one str per row; ValueError naming the row of a
    non-UTF-8 text. An empty text is a text: it embeds as ``[CLS] [SEP]``, as ``Encoder.encode([""])``
    does."""
    texts = []
    for i, value in enumerate(np.asarray(array, dtype=object).reshape(-1)):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"TEXT[{i}] is not valid UTF-8 ({exc.reason} at byte "
                                 f"{exc.start})") from None
        if not isinstance(value, str):
            raise ValueError(f"TEXT[{i}] is {type(value).__name__}, expected UTF-8 bytes")
        texts.append(value)
    return texts


def bucket_length(longest: int, buckets: list[int]) -> int:
    """The smallest bucket >= ``longest`` (the last bucket is the max length, which no
    truncated text exceeds)."""
    return buckets[min(bisect.bisect_left(buckets, longest), len(buckets) - 1)]


class TokenizerModel(_Role):
    def __init__(self, config: dict, folder: Path, pb_utils: Any):
        from mbert.runtime.text import TextEncoder

        super().__init__(config, pb_utils)
        params = self.params
        try:
            self.buckets = sorted(int(b) for b in params.get("length_buckets", "").split(",") if b)
        except ValueError:
            raise ValueError(f"{self.name}/config.pbtxt: length_buckets must be "
                             f"comma-separated integers, got {params.get('length_buckets')!r}") from None
        if not self.buckets or self.buckets[-1] != self.max_length:
            self.buckets.append(self.max_length)
        self.text = TextEncoder(folder / TOKENIZER, self.max_length)
        self.family = self.counter = None  # the family must outlive its metric
        try:
            self.family = pb_utils.MetricFamily(name=TRUNCATED_METRIC, kind=pb_utils.MetricFamily.COUNTER,
                                                description="texts truncated to the model's max length")
            self.counter = self.family.Metric(labels={"model": str(self.name)})
        except Exception:  # noqa: BLE001 - metrics disabled on this server: truncation is still reported per row
            self.family = self.counter = None

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        responses: list[Any] = [None] * len(requests)
        texts: list[str] = []
        spans: list[tuple[int, int, int]] = []  # (request index, first text, end)
        for k, request in enumerate(requests):
            try:
                batch = decode_texts(pb.get_input_tensor_by_name(request, "TEXT").as_numpy())
            except ValueError as exc:
                responses[k] = _bad_request(pb, str(exc))
                continue
            spans.append((k, len(texts), len(texts) + len(batch)))
            texts.extend(batch)
        encodings = self.text.encode(texts)  # one call: the Rust tokenizer runs the batch in parallel
        cut_total = 0
        for k, start, end in spans:
            rows = encodings[start:end]
            counts = np.array([[len(e.ids)] for e in rows], dtype=np.int64)
            cut = np.array([[bool(e.overflowing)] for e in rows], dtype=bool)
            ids, mask = pad_batch([e.ids for e in rows], bucket_length(int(counts.max()), self.buckets),
                                  self.pad_id)
            cut_total += int(cut.sum())
            responses[k] = pb.InferenceResponse(output_tensors=[
                pb.Tensor("input_ids", ids), pb.Tensor("attention_mask", mask),
                pb.Tensor("num_tokens", counts), pb.Tensor("truncated", cut)])
        if cut_total and self.counter is not None:
            self.counter.increment(cut_total)
        return responses


def row_lengths(ids: np.ndarray, mask: np.ndarray, max_length: int) -> np.ndarray:
    """Tokens per row of a right-padded batch; ValueError unless every mask row is 1s then 0s,
    with 1..max_length tokens."""
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} must "
                         "be equal [batch, length] shapes")
    lengths = (mask != 0).sum(axis=1)
    expected = np.arange(mask.shape[1])[None, :] < lengths[:, None]
    bad = np.flatnonzero(((mask != 0) != expected).any(axis=1) | (lengths < 1) | (lengths > max_length))
    if bad.size:
        raise ValueError(f"attention_mask row {int(bad[0])} must be 1 to {max_length} ones then zeros "
                         f"(right padding), got {mask[bad[0]].tolist()[:16]}...")
    return lengths


class EncoderModel(_Role):
    def __init__(self, config: dict, folder: Path, pb_utils: Any):
        from mbert.runtime.backends.onnxruntime import OrtBackend

        super().__init__(config, pb_utils)
        self.batch_size = self.integer("batch_size")
        self.max_batch_tokens = self.integer("max_batch_tokens")
        self.backend = OrtBackend(folder / self.params["onnx_file"], self.max_length,
                                  cuda=False, precision="fp32")
        self.outputs = [o["name"] for o in config.get("output", [])]
        self.per_token = {o["name"] for o in config.get("output", [])
                          if len(o.get("dims", [])) >= 2 and int(o["dims"][0]) == -1}

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        responses: list[Any] = [None] * len(requests)
        rows: list[tuple[int, int, np.ndarray]] = []  # (request, row, token ids)
        shapes: dict[int, tuple[int, int]] = {}
        wanted: dict[int, list[str]] = {}
        for k, request in enumerate(requests):
            try:
                ids = pb.get_input_tensor_by_name(request, "input_ids").as_numpy()
                mask = pb.get_input_tensor_by_name(request, "attention_mask").as_numpy()
                lengths = row_lengths(ids, mask, self.max_length)
            except ValueError as exc:
                responses[k] = _bad_request(pb, str(exc))
                continue
            shapes[k] = ids.shape
            wanted[k] = [n for n in self.outputs if n in set(request.requested_output_names())] \
                or self.outputs
            rows += [(k, r, ids[r, :n]) for r, n in enumerate(lengths.tolist())]
        names = [n for n in self.outputs if any(n in w for w in wanted.values())]
        results = {k: {n: _Rows(shapes[k][0], shapes[k][1] if n in self.per_token else None)
                       for n in wanted[k]} for k in wanted}
        failed: dict[int, str] = {}
        lengths = [len(r[2]) for r in rows]
        for idx in plan_batches(lengths, self.batch_size, self.max_batch_tokens, self.backend.pad_to):
            ids, mask = pad_batch([rows[i][2] for i in idx], self.backend.pad_to(lengths[idx[0]], len(idx)),
                                  self.pad_id)
            try:
                got = self.backend.run(ids, mask, names)
            except Exception as exc:  # noqa: BLE001 - fail the requests of this batch, keep serving
                failed.update({rows[i][0]: f"ONNX Runtime failed: {exc}" for i in idx})
                continue
            for b, i in enumerate(idx):
                k, r, tokens = rows[i]
                for n in wanted[k]:
                    results[k][n][r] = got[n][b, : len(tokens)] if n in self.per_token else got[n][b]
        for k, outs in results.items():
            if k in failed:
                responses[k] = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(failed[k]))
            else:
                responses[k] = pb.InferenceResponse(output_tensors=[pb.Tensor(n, rows_.array())
                                                                    for n, rows_ in outs.items()])
        return responses


class _Rows:
    """One request's output, filled row by row: per-token outputs padded with zeros to the
    request's length, others stacked."""

    def __init__(self, count: int, length: int | None):
        self.rows: list[np.ndarray | None] = [None] * count
        self.length = length

    def __setitem__(self, r: int, value: np.ndarray) -> None:
        self.rows[r] = value

    def array(self) -> np.ndarray:
        if self.length is None:
            return np.ascontiguousarray(np.stack(self.rows))
        first = self.rows[0]
        out = np.zeros((len(self.rows), self.length) + first.shape[1:], dtype=first.dtype)
        for r, row in enumerate(self.rows):
            out[r, : len(row)] = row
        return out
