"""What the Triton repository writer needs to know about a bundle (:class:`TritonSpec`, typed and
checked), and the Triton types of its tensors."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from mbert.bundle import Profile
from mbert.bundle.errors import BundleError
from mbert.bundle.names import FP32_GRAPH, TRITON_ENCODERS
from mbert.bundle.tensors import INPUT_NAMES, TensorSpec

_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
          "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "bool": "TYPE_BOOL",
          "string": "TYPE_STRING"}
TOKENIZER_EXTRA = (("num_tokens", "TYPE_INT64"), ("truncated", "TYPE_BOOL"))
def dims(t: TensorSpec) -> list[int]:
    """Triton ``dims``: the shape without its batch axis, symbolic axes as -1."""
    if t.dtype not in _TYPES:
        raise BundleError(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}")
    if len(t.shape) < 2 or not isinstance(t.shape[0], str):
        raise BundleError(f"tensor {t.name!r} has shape {list(t.shape)}; Triton batching needs a symbolic batch "
                          "axis first and at least one more axis")
    out = []
    for dim in t.shape[1:]:
        if isinstance(dim, str):
            out.append(-1)
        elif isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
            out.append(dim)
        else:
            raise BundleError(f"tensor {t.name!r} has invalid dimension {dim!r}")
    return out


DEFAULT_BATCH_TOKENS = 16384  # the runtime Encoder's default padded-token budget per backend call


@dataclass(frozen=True)
class TritonSpec:
    """What the repository writer needs to know about a bundle (see the module docstring).

    ``max_length``: tokens per text after truncation, the runtime Encoder's ``max_length``
    (``min(max_seq_len, sentence-transformers max_seq_length)``). ``inputs``/``outputs``: the
    graph's tensors (``input_ids``/``attention_mask`` in; outputs as the graph declares them).
    ``onnx_file``: the FP32 graph the Python encoder runs on CPU; ``onnx_backend_file``: the graph
    of the ONNX Runtime backend model (default ``onnx_file``; pass ``model.fp16.onnx`` for GPU
    servers). ``profiles``: the plan's optimization profiles. ``length_buckets``: padded lengths
    the tokenizer emits (default :func:`default_buckets`). ``batch_tokens``: padded tokens per
    ONNX Runtime call of the Python encoder. ``ensemble_outputs``: the model outputs the ensemble
    returns (default: all but ``last_hidden_state`` when there are others).
    """

    name: str
    max_length: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    pad_id: int
    max_batch: int = 32
    encoder: str = "python"
    has_plan: bool = False
    no_plan_reason: str = "the bundle has no model.plan yet"  # said in the README when has_plan is False
    profiles: tuple[Profile, ...] = ()
    onnx_file: str = FP32_GRAPH
    onnx_backend_file: str | None = None
    ensemble_outputs: tuple[str, ...] | None = None
    length_buckets: tuple[int, ...] | None = None
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    preferred_batch_sizes: tuple[int, ...] = field(default=())
    max_queue_delay_us: int = 0

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "inputs", tuple(self.inputs))
        put(self, "outputs", tuple(self.outputs))
        for key in ("max_length", "pad_id", "max_batch", "batch_tokens", "max_queue_delay_us"):
            value = getattr(self, key)
            low = 0 if key in ("pad_id", "max_queue_delay_us") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BundleError(f"TritonSpec.{key} must be an int >= {low}, got {value!r}")
        if sorted(t.name for t in self.inputs) != sorted(INPUT_NAMES):
            raise BundleError(f"model inputs are {[t.name for t in self.inputs]}; the Triton "
                              f"tokenizer feeds exactly {list(INPUT_NAMES)}")
        if not self.outputs:
            raise BundleError("the model has no outputs")
        for t in self.inputs + self.outputs:
            dims(t)  # validates dtype and shape
        clash = {t.name for t in self.outputs} & {n for n, _ in TOKENIZER_EXTRA}
        if clash:
            raise BundleError(f"model outputs {sorted(clash)} clash with the tokenizer's outputs")
        if self.encoder not in TRITON_ENCODERS:
            raise BundleError(f"encoder must be one of {', '.join(TRITON_ENCODERS)}, got {self.encoder!r}")
        if self.encoder == "trt" and not self.has_plan:
            raise BundleError("encoder='trt' needs a bundle with model.plan")
        put(self, "profiles", tuple(self.profiles))
        _check_profiles(self.profiles, self.max_batch, self.max_length)
        sizes = tuple(sorted(set(self.preferred_batch_sizes)))
        if any(not 1 <= s <= self.max_batch for s in sizes):
            raise BundleError(f"preferred_batch_sizes {list(self.preferred_batch_sizes)} must lie "
                              f"in 1..{self.max_batch}")
        put(self, "preferred_batch_sizes", sizes)
        buckets = default_buckets(self.max_length) if self.length_buckets is None else \
            tuple(sorted(set(self.length_buckets)))
        if not buckets or any(not isinstance(b, int) or not 1 <= b <= self.max_length
                              for b in buckets):
            raise BundleError(f"length_buckets {self.length_buckets} must be ints in "
                              f"1..{self.max_length}")
        put(self, "length_buckets", buckets if buckets[-1] == self.max_length
            else buckets + (self.max_length,))
        names = [t.name for t in self.outputs]
        if self.ensemble_outputs is None:
            chosen = [n for n in names if n != "last_hidden_state"] or names
        else:
            chosen = list(self.ensemble_outputs)
            unknown = sorted(set(chosen) - set(names))
            if unknown or not chosen:
                raise BundleError(f"ensemble_outputs {chosen} must be a non-empty subset of the "
                                  f"model outputs {names}")
        put(self, "ensemble_outputs", tuple(chosen))

    @property
    def model_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.name).strip(".") or "model"


def default_buckets(max_length: int) -> tuple[int, ...]:
    """Powers of two from 16 below ``max_length``, then ``max_length``: at most 2x padding, and
    few enough shapes that concurrent requests share them."""
    out, n = [], 16
    while n < max_length:
        out.append(n)
        n *= 2
    return tuple(out) + (max_length,)


def _check_profiles(profiles: Sequence[Profile], max_batch: int, max_length: int) -> None:
    for index, profile in enumerate(profiles):
        if profile.min[0] != 1 or profile.max[0] < max_batch:
            raise BundleError(f"engine profile #{index} ({profile}) must accept every batch size "
                              f"1..{max_batch} that Triton may send")
    if profiles and max(p.max[1] for p in profiles) < max_length:
        raise BundleError(f"engine profiles stop at sequence length "
                          f"{max(p.max[1] for p in profiles)} but the tokenizer emits up to "
                          f"{max_length} tokens")


