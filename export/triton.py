"""Write a Triton Inference Server model repository for a bundle: ``<bundle>/triton/``.

Input: the bundle folder and a :class:`TritonSpec` (typed; the writer reads no manifest).
Models (``<name>`` is ``spec.name`` with characters other than ``[A-Za-z0-9_.-]`` replaced by
``_``):

* ``<name>``: ensemble TEXT -> ``<name>_tokenizer`` -> encoder -> the model's outputs (by default
  all but ``last_hidden_state``; see ``TritonSpec.ensemble_outputs``), plus the tokenizer's
  ``num_tokens`` and ``truncated``.
* ``<name>_tokenizer``: Python backend; truncates exactly as ``mbert.runtime`` does (its
  ``TextEncoder``) and pads each request to a length bucket.
* ``<name>_python``: Python backend running ONNX Runtime (CPU) on the FP32 graph; batches rows of
  all queued requests with the runtime's own length-sorted token-budget batching.
* ``<name>_onnx``: ONNX Runtime backend (``onnxruntime_onnx``, KIND_AUTO), for servers that have it.
* ``<name>_trt``: TensorRT backend (``tensorrt_plan``), only when the bundle has a plan. Without
  one its config and a ``1/README`` go to ``<bundle>/triton_pending/<name>_trt/``: Triton loads
  every folder of a repository, and a model with no plan would fail to load.

Which encoder the ensemble routes to (``spec.encoder``: ``python``, ``onnx`` or ``trt``) is chosen
at export (``mbert-export --triton-encoder``, recorded in the manifest) and switched later without
re-exporting: ``mbert-run serve BUNDLE --encoder onnx`` serves a private copy of the repository
whose ensemble routes there (the sealed bundle is not modified); a copy of ``triton/`` deployed
elsewhere is switched by editing the second step's ``model_name`` in ``<name>/config.pbtxt``.

Both Python models are two-line shims (``model.py`` from this package's ``triton_model.py``) over
``mbert.runtime.triton_models``: Triton's Python environment needs ``mbert-export`` installed (it is
under ``mbert-run serve``; in NVIDIA's containers ``pip install 'mbert-export[cpu]'``).

Batching: every model has ``max_batch_size = spec.max_batch`` and ``dims`` without the batch axis.
The ONNX Runtime and TensorRT models take padded rectangles, so their dynamic batchers merge only
requests of equal padded length: the tokenizer pads each request to the smallest of
``spec.length_buckets`` that holds its longest text, so requests of different lengths in one bucket
share a batch. The Python encoder declares ``allow_ragged_batch``: its batcher merges requests of
any length and the model re-plans the rows itself.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mbert.bundle import Manifest, Profile, TritonRecord
from mbert.modeling.errors import BundleError
from mbert.modeling.graph import INPUT_NAMES, TensorSpec

from . import triton_folders as folders
from .triton_folders import TOKENIZER_EXTRA, dims

__all__ = ["ENCODERS", "TritonSpec", "default_buckets", "write_triton_repository", "spec_for", "record_of"]

ENCODERS = ("python", "onnx", "trt")
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
    onnx_file: str = "model.onnx"
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
        if self.encoder not in ENCODERS:
            raise BundleError(f"encoder must be one of {', '.join(ENCODERS)}, got {self.encoder!r}")
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


def write_triton_repository(bundle_dir: str | Path, spec: TritonSpec) -> Path:
    """Write ``<bundle>/triton/`` (replacing any previous one and ``triton_pending/``) and return
    its path. Large files are hard-linked when possible, else copied."""
    bundle = Path(bundle_dir)
    name = spec.model_name
    backend_onnx = spec.onnx_backend_file or spec.onnx_file
    sources = {"the Python encoder": bundle / spec.onnx_file,
               "the ONNX Runtime model": bundle / backend_onnx,
               "the tokenizer": bundle / "tokenizer.json"}
    if spec.has_plan:
        sources["the TensorRT model"] = bundle / "model.plan"
    for kind, path in sources.items():
        if not path.is_file():
            raise BundleError(f"bundle {bundle} has no {path.name} (needed for {kind})")

    stage = Path(tempfile.mkdtemp(prefix=".triton-", dir=bundle))
    try:
        repo, pending = stage / "triton", stage / "triton_pending"
        folders.tokenizer(repo / f"{name}_tokenizer", bundle / "tokenizer.json", spec)
        folders.python_encoder(repo / f"{name}_python", bundle / spec.onnx_file, spec)
        folders.onnx_model(repo / f"{name}_onnx", bundle / backend_onnx, spec)
        folders.trt_model(((repo if spec.has_plan else pending) / f"{name}_trt"),
                          bundle / "model.plan" if spec.has_plan else None, spec)
        folders.ensemble(repo / name, spec)
        (repo / "README.md").write_text(folders.readme(spec))
        for folder in ("triton", "triton_pending"):
            target = bundle / folder
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                shutil.rmtree(target)
            if (stage / folder).exists():
                os.replace(stage / folder, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return bundle / "triton"


def spec_for(manifest: Manifest, *, max_batch: int, encoder: str = "python",
             length_buckets: tuple[int, ...] | None = None,
             ensemble_outputs: tuple[str, ...] | None = None) -> TritonSpec:
    """The repository of the bundle ``manifest`` describes: its graphs, tensors and engine."""
    limits = [manifest.max_seq_len] + ([manifest.pooling.max_seq_length]
                                      if manifest.pooling and manifest.pooling.max_seq_length else [])
    fp16 = manifest.graph("fp16")
    engine, reason = manifest.engine, "the bundle has no model.plan yet"
    if engine is not None and engine.family != "tensorrt":  # Triton's tensorrt_plan links datacenter TensorRT:
        engine = None  # it cannot load a TensorRT-RTX plan, so the repository gets no plan model for one
        reason = ("the bundle's model.plan was built by TensorRT-RTX, which Triton's tensorrt_plan backend "
                  "(datacenter TensorRT) cannot load")
    return TritonSpec(name=manifest.name, max_length=min(limits), inputs=manifest.io.inputs,
                      outputs=manifest.io.outputs, pad_id=manifest.model.pad_token_id, max_batch=max_batch,
                      encoder=encoder, has_plan=engine is not None, no_plan_reason=reason,
                      profiles=engine.profiles if engine else (),
                      onnx_file=manifest.graph("fp32").file, onnx_backend_file=fp16.file if fp16 else None,
                      ensemble_outputs=ensemble_outputs, length_buckets=length_buckets)


def record_of(spec: TritonSpec) -> TritonRecord:
    """The manifest's record of a repository written from ``spec`` (enough to write it again)."""
    return TritonRecord(repository="triton", ensemble=spec.model_name, encoder=spec.encoder,
                        max_batch=spec.max_batch, length_buckets=spec.length_buckets,
                        ensemble_outputs=spec.ensemble_outputs)


def _check_profiles(profiles: Sequence[Profile], max_batch: int, max_length: int) -> None:
    for index, profile in enumerate(profiles):
        if profile.min[0] != 1 or profile.max[0] < max_batch:
            raise BundleError(f"engine profile #{index} ({profile}) must accept every batch size "
                              f"1..{max_batch} that Triton may send")
    if profiles and max(p.max[1] for p in profiles) < max_length:
        raise BundleError(f"engine profiles stop at sequence length "
                          f"{max(p.max[1] for p in profiles)} but the tokenizer emits up to "
                          f"{max_length} tokens")


