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
here and switched later without re-exporting: ``mbert-run serve BUNDLE --encoder onnx
[--switch-only]`` (rewrites the ensemble's second step), or by editing that ``model_name`` by hand.

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
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from mbert.export.pbtxt import Enum, to_pbtxt
from mbert.export.tensorrt import Profile
from mbert.modeling.errors import BundleError, EngineError

__all__ = ["ENCODERS", "TensorIO", "TritonSpec", "default_buckets", "write_triton_repository",
           "to_pbtxt", "Enum"]

ENCODERS = ("python", "onnx", "trt")
_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
          "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "bool": "TYPE_BOOL",
          "string": "TYPE_STRING"}
_MODEL_INPUTS = ("input_ids", "attention_mask")
_TOKENIZER_EXTRA = (("num_tokens", "TYPE_INT64"), ("truncated", "TYPE_BOOL"))
DEFAULT_BATCH_TOKENS = 16384  # the runtime Encoder's default padded-token budget per backend call


@dataclass(frozen=True)
class TensorIO:
    """One graph input or output: ``shape`` starts with the symbolic batch axis (``"batch"``);
    other symbolic axes (``"sequence"``) become ``-1`` in Triton's ``dims``."""

    name: str
    dtype: str  # numpy-style: int64, float32, float16, bool, ...
    shape: tuple[int | str, ...]

    @classmethod
    def of(cls, value: Any) -> "TensorIO":
        """From a TensorIO, anything with ``name``/``dtype``/``shape`` attributes (the model's
        ``TensorSpec``), or a ``{"name", "dtype", "shape"}`` dict."""
        if isinstance(value, cls):
            return value
        try:
            if isinstance(value, dict):
                name, dtype, shape = value["name"], value["dtype"], value["shape"]
            else:
                name, dtype, shape = value.name, value.dtype, value.shape
            return cls(str(name), str(dtype), tuple(shape))
        except (KeyError, AttributeError, TypeError):
            raise BundleError(f"tensor {value!r} needs a name, a dtype and a shape") from None

    def dims(self) -> list[int]:
        """Triton ``dims``: the shape without its batch axis, symbolic axes as -1."""
        if self.dtype not in _TYPES:
            raise BundleError(f"tensor {self.name!r} has unsupported dtype {self.dtype!r}")
        if len(self.shape) < 2 or not isinstance(self.shape[0], str):
            raise BundleError(f"tensor {self.name!r} has shape {list(self.shape)}; Triton batching "
                              "needs a symbolic batch axis first and at least one more axis")
        out = []
        for dim in self.shape[1:]:
            if isinstance(dim, str):
                out.append(-1)
            elif isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
                out.append(dim)
            else:
                raise BundleError(f"tensor {self.name!r} has invalid dimension {dim!r}")
        return out

    def triton(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": Enum(_TYPES[self.dtype]), "dims": self.dims()}


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
    inputs: tuple[TensorIO, ...]
    outputs: tuple[TensorIO, ...]
    pad_id: int
    max_batch: int = 32
    encoder: str = "python"
    has_plan: bool = False
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
        put(self, "inputs", tuple(TensorIO.of(t) for t in self.inputs))
        put(self, "outputs", tuple(TensorIO.of(t) for t in self.outputs))
        for key in ("max_length", "pad_id", "max_batch", "batch_tokens", "max_queue_delay_us"):
            value = getattr(self, key)
            low = 0 if key in ("pad_id", "max_queue_delay_us") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BundleError(f"TritonSpec.{key} must be an int >= {low}, got {value!r}")
        if sorted(t.name for t in self.inputs) != sorted(_MODEL_INPUTS):
            raise BundleError(f"model inputs are {[t.name for t in self.inputs]}; the Triton "
                              f"tokenizer feeds exactly {list(_MODEL_INPUTS)}")
        if not self.outputs:
            raise BundleError("the model has no outputs")
        for t in self.inputs + self.outputs:
            t.dims()  # validates dtype and shape
        clash = {t.name for t in self.outputs} & {n for n, _ in _TOKENIZER_EXTRA}
        if clash:
            raise BundleError(f"model outputs {sorted(clash)} clash with the tokenizer's outputs")
        if self.encoder not in ENCODERS:
            raise BundleError(f"encoder must be one of {', '.join(ENCODERS)}, got {self.encoder!r}")
        if self.encoder == "trt" and not self.has_plan:
            raise BundleError("encoder='trt' needs a bundle with model.plan")
        try:
            put(self, "profiles", tuple(Profile.from_any(p) for p in self.profiles or ()))
        except EngineError as exc:
            raise BundleError(str(exc)) from exc
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


def write_triton_repository(bundle_dir: str | Path, spec: TritonSpec | dict,
                            **legacy: Any) -> Path:
    """Write ``<bundle>/triton/`` (replacing any previous one and ``triton_pending/``) and return
    its path. Large files are hard-linked when possible, else copied."""
    if not isinstance(spec, TritonSpec):
        spec = _spec_from_manifest_dict(spec, **legacy)
    elif legacy:
        raise TypeError(f"unexpected arguments with a TritonSpec: {sorted(legacy)}")
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
        _write_tokenizer(repo / f"{name}_tokenizer", bundle / "tokenizer.json", spec)
        _write_python_encoder(repo / f"{name}_python", bundle / spec.onnx_file, spec)
        _write_onnx(repo / f"{name}_onnx", bundle / backend_onnx, spec)
        _write_trt(((repo if spec.has_plan else pending) / f"{name}_trt"),
                   bundle / "model.plan" if spec.has_plan else None, spec)
        _write_ensemble(repo / name, spec)
        (repo / "README.md").write_text(_readme(spec))
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


def _spec_from_manifest_dict(manifest: dict, *, has_plan: bool, max_batch: int,
                             profiles: Sequence[Any] | None = None, **options: Any) -> TritonSpec:
    """TRANSITIONAL, for the manifest-dict call sites of ``export/pipeline.py`` and
    ``export/engine_only.py`` until they build a TritonSpec from the typed manifest; then delete."""
    try:
        pooling = manifest.get("pooling") or {}
        limits = [manifest["max_seq_len"]] + ([pooling["max_seq_length"]]
                                              if pooling.get("max_seq_length") else [])
        arts = manifest.get("artifacts") or {}
        return TritonSpec(
            name=str(manifest["name"]), max_length=min(limits),
            inputs=tuple(manifest["io"]["inputs"]), outputs=tuple(manifest["io"]["outputs"]),
            pad_id=manifest["model"]["pad_token_id"], max_batch=max_batch, has_plan=has_plan,
            profiles=tuple(profiles or ()),
            onnx_backend_file="model.fp16.onnx" if arts.get("onnx_fp16") else None, **options)
    except (KeyError, TypeError) as exc:
        raise BundleError(f"manifest.json lacks {exc} (needs name, max_seq_len, io, "
                          "model.pad_token_id)") from None


def _check_profiles(profiles: Sequence[Profile], max_batch: int, max_length: int) -> None:
    for index, profile in enumerate(profiles):
        if profile.min[0] != 1 or profile.max[0] < max_batch:
            raise BundleError(f"engine profile #{index} ({profile}) must accept every batch size "
                              f"1..{max_batch} that Triton may send")
    if profiles and max(p.max[1] for p in profiles) < max_length:
        raise BundleError(f"engine profiles stop at sequence length "
                          f"{max(p.max[1] for p in profiles)} but the tokenizer emits up to "
                          f"{max_length} tokens")


# --- model folders ------------------------------------------------------------------------------

def _write_config(model_dir: Path, config: dict[str, Any], comments: Sequence[str] = ()) -> None:
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(to_pbtxt(config, comments))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _params(**values: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"string_value": str(v)}} for k, v in values.items()]


def _batching(spec: TritonSpec) -> dict[str, Any]:
    return {"preferred_batch_size": list(spec.preferred_batch_sizes) or None,
            "max_queue_delay_microseconds": spec.max_queue_delay_us or None}


def _copy_model_py(model_dir: Path) -> None:
    template = resources.files("mbert.export").joinpath("triton_model.py").read_text("utf-8")
    (model_dir / "1" / "model.py").write_text(template)


def _tokenizer_outputs() -> list[dict[str, Any]]:
    return ([{"name": n, "data_type": Enum("TYPE_INT64"), "dims": [-1]} for n in _MODEL_INPUTS]
            + [{"name": n, "data_type": Enum(t), "dims": [1]} for n, t in _TOKENIZER_EXTRA])


def _write_tokenizer(model_dir: Path, tokenizer_json: Path, spec: TritonSpec) -> None:
    _write_config(model_dir, {
        "name": model_dir.name, "backend": "python", "max_batch_size": spec.max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": _tokenizer_outputs(),
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": 1}],
        "dynamic_batching": {},
        "parameters": _params(role="tokenizer", max_length=spec.max_length, pad_id=spec.pad_id,
                              length_buckets=",".join(map(str, spec.length_buckets))),
    }, ["Tokenizer (Python backend; code in mbert.runtime.triton_models): TEXT [batch, 1] UTF-8",
        "-> input_ids, attention_mask [batch, length] (truncated to max_length as mbert.runtime",
        "truncates; padded to the smallest length bucket holding the request's longest text),",
        "num_tokens [batch, 1] (tokens kept) and truncated [batch, 1] (the text was cut).",
        "An empty or non-UTF-8 text fails its request with an error naming the row."])
    _copy_model_py(model_dir)
    _link_or_copy(tokenizer_json, model_dir / "1" / "tokenizer.json")


def _write_python_encoder(model_dir: Path, onnx_path: Path, spec: TritonSpec) -> None:
    inputs = [dict(t.triton(), allow_ragged_batch=True) for t in spec.inputs]
    _write_config(model_dir, {
        "name": model_dir.name, "backend": "python", "max_batch_size": spec.max_batch,
        "input": inputs, "output": [t.triton() for t in spec.outputs],
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": 1}],
        "dynamic_batching": _batching(spec),
        "parameters": _params(role="encoder", onnx_file="model.onnx", max_length=spec.max_length,
                              pad_id=spec.pad_id, batch_size=spec.max_batch,
                              max_batch_tokens=spec.batch_tokens),
    }, [f"ONNX Runtime (CPU) inside the Python backend, on the bundle's {onnx_path.name}; needs",
        "only Triton's Python backend. allow_ragged_batch: requests of any length share a batch;",
        "the model strips their padding and re-batches all rows with mbert.runtime's",
        "length-sorted token-budget batching (batch_size rows, max_batch_tokens padded tokens)."])
    _copy_model_py(model_dir)
    _link_onnx(onnx_path, model_dir / "1")


def _write_onnx(model_dir: Path, onnx_path: Path, spec: TritonSpec) -> None:
    _write_config(model_dir, {
        "name": model_dir.name, "platform": "onnxruntime_onnx", "max_batch_size": spec.max_batch,
        "input": [t.triton() for t in spec.inputs], "output": [t.triton() for t in spec.outputs],
        "instance_group": [{"kind": Enum("KIND_AUTO"), "count": 1}],
        "dynamic_batching": _batching(spec),
    }, [f"ONNX Runtime backend, from the bundle's {onnx_path.name}. KIND_AUTO: GPU when present,",
        "else CPU. The dynamic batcher merges requests of equal padded length (the tokenizer",
        "pads to length buckets)."])
    _link_onnx(onnx_path, model_dir / "1")


def _link_onnx(onnx_path: Path, version_dir: Path) -> None:
    _link_or_copy(onnx_path, version_dir / "model.onnx")
    for location in _external_data(onnx_path):
        _link_or_copy(onnx_path.parent / location, version_dir / location)


def _write_trt(model_dir: Path, plan: Path | None, spec: TritonSpec) -> None:
    comments = ["TensorRT engine. A plan runs only with the TensorRT version that built it",
                "(it must match Triton's TensorRT backend), on the GPU architecture it was",
                "built for. Triton's tensorrt_plan backend links datacenter TensorRT: it cannot",
                "load a TensorRT-RTX plan."]
    comments += [f"optimization profile {i}: (batch, seq) {p}" for i, p in enumerate(spec.profiles)]
    comments += ["Triton picks, per request shape, among the profiles listed in instance_group.",
                 "The dynamic batcher merges requests of equal padded length (length buckets)."]
    group: dict[str, Any] = {"kind": Enum("KIND_GPU"), "count": 1,
                             "profile": [str(i) for i in range(len(spec.profiles))]}
    _write_config(model_dir, {
        "name": model_dir.name, "platform": "tensorrt_plan", "max_batch_size": spec.max_batch,
        "input": [t.triton() for t in spec.inputs], "output": [t.triton() for t in spec.outputs],
        "instance_group": [group], "dynamic_batching": _batching(spec),
    }, comments)
    if plan is not None:
        _link_or_copy(plan, model_dir / "1" / "model.plan")
    else:
        (model_dir / "1" / "README").write_text(_PENDING_README.format(name=model_dir.name))


def _write_ensemble(model_dir: Path, spec: TritonSpec) -> None:
    name = spec.model_name
    outputs = [t.triton() for t in spec.outputs if t.name in spec.ensemble_outputs]
    extra = [{"name": n, "data_type": Enum(t), "dims": [1]} for n, t in _TOKENIZER_EXTRA]
    _write_config(model_dir, {
        "name": name, "platform": "ensemble", "max_batch_size": spec.max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": outputs + extra,
        "ensemble_scheduling": {"step": [
            {"model_name": f"{name}_tokenizer", "model_version": -1,
             "input_map": [{"key": "TEXT", "value": "TEXT"}],
             "output_map": [{"key": n, "value": n}
                            for n in _MODEL_INPUTS + tuple(n for n, _ in _TOKENIZER_EXTRA)]},
            {"model_name": f"{name}_{spec.encoder}", "model_version": -1,
             "input_map": [{"key": n, "value": n} for n in _MODEL_INPUTS],
             "output_map": [{"key": t["name"], "value": t["name"]} for t in outputs]},
        ]},
    }, ["Ensemble: TEXT -> tokenizer -> encoder. The second step's model_name picks the encoder:",
        f'"{name}_python" (ONNX Runtime in the Python backend, CPU), "{name}_onnx" (ONNX Runtime',
        f'backend) or "{name}_trt" (TensorRT).',
        "Switch without re-exporting: mbert-run serve BUNDLE --encoder onnx --switch-only"])
    # an ensemble has no files of its own, but Triton wants a version folder
    (model_dir / "1" / ".keep").write_text("")


def _external_data(onnx_path: Path) -> list[str]:
    """Relative locations of the external data files an ONNX model refers to."""
    import onnx  # noqa: PLC0415 - heavy, only needed here

    model = onnx.load(str(onnx_path), load_external_data=False)
    found: set[str] = set()

    def tensor(t: Any) -> None:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in t.external_data if e.key == "location")

    def nodes(items: Any) -> None:
        for node in items:
            for attr in node.attribute:
                if attr.HasField("t"):
                    tensor(attr.t)
                for t in attr.tensors:
                    tensor(t)
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    graph(g)

    def graph(g: Any) -> None:
        for t in g.initializer:
            tensor(t)
        for sparse in g.sparse_initializer:
            tensor(sparse.values)
            tensor(sparse.indices)
        nodes(g.node)

    graph(model.graph)
    for function in model.functions:
        nodes(function.node)
    for location in found:
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise BundleError(f"{onnx_path.name} refers to external data outside its folder: "
                              f"{location!r}")
        if not (onnx_path.parent / location).is_file():
            raise BundleError(f"{onnx_path.name} refers to missing external data {location!r}")
    return sorted(found)


_PENDING_README = """\
{name}: TensorRT model without an engine yet
==========================================================

This folder is outside the Triton repository (../../triton/) on purpose: Triton loads every
model folder it finds, and one without 1/model.plan fails to load.

To enable it, on a machine with the serving GPU and the TensorRT version of your Triton release
(datacenter TensorRT: Triton's tensorrt_plan backend cannot load a TensorRT-RTX plan):

1. Build the engine: mbert-export --engine-only BUNDLE (rewrites ../../triton/ with it), or
2. by hand: copy the plan to 1/model.plan here, list the engine's profiles in config.pbtxt's
   instance_group profile field, and move this folder into ../../triton/.
"""


def _readme(spec: TritonSpec) -> str:
    name = spec.model_name
    trt = (f"- `{name}_trt/`: TensorRT plan (platform tensorrt_plan, KIND_GPU).\n"
           if spec.has_plan else
           f"- `{name}_trt` is not here: the bundle has no model.plan yet; see "
           f"`../triton_pending/{name}_trt/1/README`.\n")
    return (f"# Triton model repository for `{name}`\n\n"
            f"Serve on CPU with `mbert-run serve BUNDLE` (starts `tritonserver` on this folder).\n"
            f"Models:\n\n"
            f"- `{name}/`: ensemble, input `TEXT` (TYPE_STRING, [batch, 1], UTF-8), outputs "
            f"{', '.join(f'`{n}`' for n in spec.ensemble_outputs)}, `num_tokens`, `truncated`; "
            f"routed through `{name}_tokenizer` to `{name}_{spec.encoder}`.\n"
            f"- `{name}_tokenizer/`: Python backend (code in `mbert.runtime.triton_models`).\n"
            f"- `{name}_python/`: ONNX Runtime on CPU inside the Python backend; needs only "
            f"the Python backend.\n"
            f"- `{name}_onnx/`: ONNX Runtime backend (NVIDIA's Triton containers have it).\n{trt}\n"
            "The Python models need `mbert-export` in Triton's Python environment (`mbert-run "
            "serve` uses the Python it runs in; in a container: `pip install "
            "'mbert-export[cpu]'`).\n\n"
            f"To route the ensemble to another encoder, run `mbert-run serve BUNDLE --encoder "
            f"onnx|trt|python --switch-only`, or change `model_name` of the second step in "
            f"`{name}/config.pbtxt` to `{name}_python`, `{name}_onnx` or `{name}_trt`.\n\n"
            f"Batching: the tokenizer pads each request to a length bucket "
            f"({', '.join(map(str, spec.length_buckets))}), so the ONNX Runtime and TensorRT "
            f"batchers merge requests within a bucket; the Python encoder merges requests of any "
            f"length and re-batches their rows by length and token budget.\n")
