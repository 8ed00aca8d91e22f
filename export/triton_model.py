"""Triton Python-backend tokenizer for an mbert-export bundle.

This file is a template: mbert-export copies it to ``<name>_tokenizer/1/model.py`` in the Triton
model repository and never imports it. Next to it sits the bundle's ``tokenizer.json``.

Input ``TEXT`` (TYPE_STRING, shape [batch, 1]); outputs ``input_ids`` and ``attention_mask``
(TYPE_INT64, shape [batch, length]) where ``length`` is the longest tokenized text of the request
(special tokens included, truncated to the ``max_seq_len`` parameter) and shorter rows are padded
with the ``pad_id`` parameter (else the tokenizer's own padding token) and masked with 0.

``tokenize_batch`` is a plain function so it can be tested without Triton.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

try:  # only exists inside Triton's Python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - outside Triton (tests, tooling)
    pb_utils = None

PAD_TOKENS = ("[PAD]", "<pad>", "<|padding|>", "<|pad|>")


def resolve_pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id: its padding config, else a conventional pad token."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    for token in PAD_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise ValueError("tokenizer.json has no padding token; set the pad_id parameter in "
                     "config.pbtxt")


def tokenize_batch(tokenizer: Any, texts: Iterable[str], max_len: int,
                   pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` (with special tokens), truncate to ``max_len`` tokens and right-pad to the
    longest row. Returns int64 ``(input_ids, attention_mask)`` of shape [len(texts), length]."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    truncation = tokenizer.truncation
    if not truncation or truncation.get("max_length") != max_len:
        tokenizer.enable_truncation(max_length=max_len)
    if tokenizer.padding is not None:
        tokenizer.no_padding()  # padding is done below, to the longest row of this request
    encodings = tokenizer.encode_batch(list(texts))
    length = max((len(e.ids) for e in encodings), default=0)
    input_ids = np.full((len(encodings), length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(encodings), length), dtype=np.int64)
    for row, encoding in enumerate(encodings):
        n = len(encoding.ids)
        input_ids[row, :n] = encoding.ids
        attention_mask[row, :n] = 1
    return input_ids, attention_mask


def decode_texts(array: np.ndarray) -> list[str]:
    """TYPE_STRING tensors arrive as numpy object arrays of bytes; one text per row."""
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v)
            for v in np.asarray(array, dtype=object).reshape(-1)]


class TritonPythonModel:
    """Triton Python backend entry points: initialize / execute / finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        from tokenizers import Tokenizer

        config = json.loads(args["model_config"])
        params = {key: value.get("string_value", "")
                  for key, value in config.get("parameters", {}).items()}
        here = Path(__file__).resolve().parent
        self.tokenizer = Tokenizer.from_file(str(here / "tokenizer.json"))
        self.max_len = int(params["max_seq_len"])
        pad = params.get("pad_id", "")
        self.pad_id = int(pad) if pad != "" else resolve_pad_id(self.tokenizer)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
                ids, mask = tokenize_batch(self.tokenizer, decode_texts(text), self.max_len,
                                           self.pad_id)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("input_ids", ids),
                    pb_utils.Tensor("attention_mask", mask),
                ]))
            except Exception as exc:  # noqa: BLE001 - report per request, keep serving
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"tokenization failed: {exc}")))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None
