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

Both Python models are two-line shims (``model.py`` from this package's ``model_template.py``) over
``mbert.runtime.serve.models``: Triton's Python environment needs ``mbert-export`` installed (it is
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
import shutil
import tempfile
from pathlib import Path

from mbert.bundle import Manifest, TritonRecord
from mbert.bundle.errors import BundleError
from mbert.bundle.names import PLAN, TOKENIZER, TRITON, TRITON_PENDING
from mbert.export.triton import folders
from mbert.export.triton.spec import TritonSpec, default_buckets

__all__ = ["TritonSpec", "default_buckets", "write_triton_repository", "spec_for", "record_of"]

def write_triton_repository(bundle_dir: str | Path, spec: TritonSpec) -> Path:
    """Write ``<bundle>/triton/`` (replacing any previous one and ``triton_pending/``) and return
    its path. Large files are hard-linked when possible, else copied."""
    bundle = Path(bundle_dir)
    name = spec.model_name
    backend_onnx = spec.onnx_backend_file or spec.onnx_file
    sources = {"the Python encoder": bundle / spec.onnx_file,
               "the ONNX Runtime model": bundle / backend_onnx,
               "the tokenizer": bundle / TOKENIZER}
    if spec.has_plan:
        sources["the TensorRT model"] = bundle / PLAN
    for kind, path in sources.items():
        if not path.is_file():
            raise BundleError(f"bundle {bundle} has no {path.name} (needed for {kind})")

    stage = Path(tempfile.mkdtemp(prefix=".triton-", dir=bundle))
    try:
        repo, pending = stage / TRITON, stage / TRITON_PENDING
        folders.tokenizer(repo / f"{name}_tokenizer", bundle / TOKENIZER, spec)
        folders.python_encoder(repo / f"{name}_python", bundle / spec.onnx_file, spec)
        folders.onnx_model(repo / f"{name}_onnx", bundle / backend_onnx, spec)
        folders.trt_model(((repo if spec.has_plan else pending) / f"{name}_trt"),
                          bundle / PLAN if spec.has_plan else None, spec)
        folders.ensemble(repo / name, spec)
        (repo / "README.md").write_text(folders.readme(spec))
        for folder in (TRITON, TRITON_PENDING):
            target = bundle / folder
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                shutil.rmtree(target)
            if (stage / folder).exists():
                os.replace(stage / folder, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return bundle / TRITON


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
    return TritonRecord(repository=TRITON, ensemble=spec.model_name, encoder=spec.encoder,
                        max_batch=spec.max_batch, length_buckets=spec.length_buckets,
                        ensemble_outputs=spec.ensemble_outputs)
