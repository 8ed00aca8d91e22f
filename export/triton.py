"""Write a Triton Inference Server model repository for a bundle: ``<bundle>/triton/``.

Models (``<name>`` is the manifest name with characters other than ``[A-Za-z0-9_.-]`` replaced by
``_``):

* ``<name>_tokenizer``: Python backend (``1/model.py`` copied from the ``triton_model.py`` template
  of this package, plus ``1/tokenizer.json``): TEXT -> input_ids, attention_mask.
* ``<name>_onnx``: ONNX Runtime (``onnxruntime_onnx``), ``1/model.onnx`` (+ external data files).
* ``<name>_trt``: TensorRT (``tensorrt_plan``), ``1/model.plan``, only when the bundle has a plan.
  Without a plan its config and a ``1/README`` go to ``<bundle>/triton_pending/<name>_trt/``
  instead: Triton loads every folder of a repository, and a model with no plan would fail to load
  (by default that stops the server).
* ``<name>``: ensemble TEXT -> tokenizer -> ``<name>_onnx`` (or ``_trt`` with
  ``ensemble_target="trt"``, or by editing the second step's ``model_name``).

Batching: every model has ``max_batch_size = max_batch`` > 0 and ``dims`` without the batch axis
(Triton's dynamic batcher needs a batch-first model with max_batch_size >= 1; with 0 it cannot
batch). Requests are merged only when their sequence lengths are equal (``allow_ragged_batch`` is
not set: the models take padded rectangles), so the batcher helps most with bucketed or fixed
lengths. Each request is padded to its own longest text by the tokenizer.

Configs are built as Python data and written by a tiny deterministic pbtxt writer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle import Manifest, Profile, TritonRecord
from mbert.bundle.schema import to_json
from mbert.modeling.errors import BundleError

__all__ = ["write_triton_repository", "repository_for", "model_name", "to_pbtxt", "Enum"]

_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
          "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "bool": "TYPE_BOOL",
          "string": "TYPE_STRING"}
_TOKENIZER_OUTPUTS = ("input_ids", "attention_mask")


class Enum(str):
    """A protobuf enum value, written unquoted (``KIND_GPU``, ``TYPE_INT64``)."""


def to_pbtxt(message: dict[str, Any], comments: Sequence[str] = ()) -> str:
    """Protobuf text format for nested dicts: dict -> ``key { }``, list of dicts ->
    ``key [ { }, { } ]``, list of scalars -> ``key: [ a, b ]``, ``None`` / ``[]`` omitted.
    Key order is kept, so equal input gives byte-identical output."""
    lines = [f"# {line}".rstrip() for c in comments for line in c.splitlines()]
    return "\n".join(lines + _message_lines(message, "")) + "\n"


def _message_lines(message: dict[str, Any], pad: str) -> list[str]:
    lines: list[str] = []
    inner = pad + "  "
    for key, value in message.items():
        if value is None or (isinstance(value, list) and not value):
            continue
        if isinstance(value, dict):
            lines += [f"{pad}{key} {{", *_message_lines(value, inner), f"{pad}}}"]
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key} [")
            for i, item in enumerate(value):
                closing = "}," if i < len(value) - 1 else "}"
                lines += [f"{inner}{{", *_message_lines(item, inner + "  "), inner + closing]
            lines.append(f"{pad}]")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def _scalar(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
        return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\{ord(m.group()):03o}", escaped) + '"'
    raise TypeError(f"cannot write {value!r} as a protobuf text scalar")


def write_triton_repository(bundle_dir: str | Path, manifest: dict[str, Any], *, has_plan: bool,
                            onnx_file: str | None = None,
                            profiles: Sequence[Profile] | None = None,
                            max_batch: int, preferred_batch_sizes: Sequence[int] | None = None,
                            max_queue_delay_us: int = 0, ensemble_target: str = "onnx") -> Path:
    """Write ``<bundle>/triton/`` (replacing any previous one) and return its path.

    ``onnx_file`` defaults to ``model.fp16.onnx`` when the bundle has it, else ``model.onnx``.
    ``profiles`` are the engine's optimization profiles (Profile or ``as_lists()`` dicts); every
    one is listed in the TensorRT instance group so Triton picks one per request shape.
    ``preferred_batch_sizes`` is left out by default, as Triton's batcher guide recommends for
    most models. Large files are hard-linked when possible, else copied.
    """
    bundle = Path(bundle_dir)
    name, max_seq_len, inputs, outputs = _read_manifest(manifest)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise BundleError(f"max_batch must be a positive int, got {max_batch!r}")
    if ensemble_target not in ("onnx", "trt"):
        raise BundleError(f"ensemble_target must be 'onnx' or 'trt', got {ensemble_target!r}")
    if ensemble_target == "trt" and not has_plan:
        raise BundleError("ensemble_target='trt' needs a bundle with model.plan")
    sizes = sorted(set(preferred_batch_sizes or []))
    if any(not 1 <= s <= max_batch for s in sizes):
        raise BundleError(f"preferred_batch_sizes {list(preferred_batch_sizes or [])} must lie in "
                          f"1..{max_batch}")
    engine_profiles = list(profiles or [])
    _check_profiles(engine_profiles, max_batch, max_seq_len)
    onnx_name = onnx_file or ("model.fp16.onnx" if (bundle / "model.fp16.onnx").is_file()
                              else "model.onnx")
    sources = {"onnx": bundle / onnx_name, "tokenizer": bundle / "tokenizer.json"}
    if has_plan:
        sources["plan"] = bundle / "model.plan"
    for kind, path in sources.items():
        if not path.is_file():
            raise BundleError(f"bundle {bundle} has no {path.name} (needed for the {kind} model)")
    pad_id = _pad_id(manifest, bundle / "config.json")

    stage = Path(tempfile.mkdtemp(prefix=".triton-", dir=bundle))
    try:
        repo, pending = stage / "triton", stage / "triton_pending"
        batching = {"preferred_batch_size": sizes or None,
                    "max_queue_delay_microseconds": max_queue_delay_us or None}
        _write_tokenizer(repo / f"{name}_tokenizer", sources["tokenizer"], max_batch,
                         max_seq_len, pad_id)
        _write_onnx(repo / f"{name}_onnx", sources["onnx"], inputs, outputs, max_batch, batching)
        trt_dir = (repo if has_plan else pending) / f"{name}_trt"
        _write_trt(trt_dir, sources.get("plan"), inputs, outputs, max_batch, batching,
                   engine_profiles)
        _write_ensemble(repo / name, name, ensemble_target, outputs, max_batch)
        (repo / "README.md").write_text(_readme(name, has_plan, ensemble_target))
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


# --- manifest -> tensors -------------------------------------------------------------------------

def _read_manifest(manifest: dict[str, Any]) -> tuple[str, int, list[dict], list[dict]]:
    try:
        raw_name, max_seq_len = manifest["name"], manifest["max_seq_len"]
        io_inputs, io_outputs = manifest["io"]["inputs"], manifest["io"]["outputs"]
    except (KeyError, TypeError) as exc:
        raise BundleError(f"manifest.json lacks {exc} (needs name, max_seq_len, io.inputs, "
                          "io.outputs)") from None
    name = model_name(str(raw_name))
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise BundleError(f"manifest max_seq_len must be a positive int, got {max_seq_len!r}")
    inputs = [_tensor(entry, "input") for entry in io_inputs]
    outputs = [_tensor(entry, "output") for entry in io_outputs]
    if sorted(t["name"] for t in inputs) != sorted(_TOKENIZER_OUTPUTS):
        raise BundleError(f"model inputs are {[t['name'] for t in inputs]}; the Triton tokenizer "
                          f"feeds exactly {list(_TOKENIZER_OUTPUTS)}")
    if not outputs:
        raise BundleError("manifest io.outputs is empty")
    return name, max_seq_len, inputs, outputs


def model_name(bundle_name: str) -> str:
    """The Triton model name of a bundle: characters other than ``[A-Za-z0-9_.-]`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", bundle_name).strip(".") or "model"


def repository_for(folder: Path, manifest: Manifest, *, max_batch: int) -> TritonRecord:
    """Write ``folder/triton/`` for the bundle ``manifest`` describes; returns the manifest's record of it."""
    # Triton's tensorrt_plan backend links datacenter TensorRT: it cannot load a TensorRT-RTX plan
    has_plan = manifest.engine is not None and manifest.engine.family == "tensorrt"
    graph = manifest.graph("fp16") or manifest.graph("fp32")
    raw = {"name": manifest.name, "max_seq_len": manifest.max_seq_len, "io": to_json(manifest.io),
           "model": {"pad_token_id": manifest.model.pad_token_id}}
    repo = write_triton_repository(folder, raw, has_plan=has_plan, onnx_file=graph.file,
                                   profiles=manifest.engine.profiles if has_plan else None, max_batch=max_batch)
    name = model_name(manifest.name)
    return TritonRecord(repo.name, name, f"{name}_onnx", max_batch)


def _tensor(entry: dict[str, Any], role: str) -> dict[str, Any]:
    """Manifest I/O entry -> Triton tensor; the batch axis (first, symbolic) is dropped."""
    try:
        name, dtype, shape = entry["name"], entry["dtype"], list(entry["shape"])
    except (KeyError, TypeError):
        raise BundleError(f"manifest {role} entry {entry!r} needs name, dtype and shape") from None
    if dtype not in _TYPES:
        raise BundleError(f"manifest {role} {name!r} has unsupported dtype {dtype!r}")
    if len(shape) < 2 or not isinstance(shape[0], str):
        raise BundleError(f"manifest {role} {name!r} has shape {shape}; Triton batching needs a "
                          "symbolic batch axis first and at least one more axis")
    dims = []
    for dim in shape[1:]:
        if isinstance(dim, str):
            dims.append(-1)
        elif isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
            dims.append(dim)
        else:
            raise BundleError(f"manifest {role} {name!r} has invalid dimension {dim!r}")
    return {"name": name, "data_type": Enum(_TYPES[dtype]), "dims": dims}


def _check_profiles(profiles: list[Profile], max_batch: int, max_seq_len: int) -> None:
    for index, profile in enumerate(profiles):
        if profile.min[0] != 1 or profile.max[0] < max_batch:
            raise BundleError(f"engine profile #{index} ({profile}) must accept every batch size "
                              f"1..{max_batch} that Triton may send")
    if profiles and max(p.max[1] for p in profiles) < max_seq_len:
        raise BundleError(f"engine profiles stop at sequence length "
                          f"{max(p.max[1] for p in profiles)} but the tokenizer emits up to "
                          f"{max_seq_len} tokens")


def _pad_id(manifest: dict[str, Any], config_json: Path) -> int | None:
    """pad_token_id from the manifest's model record, else the bundle's config.json; None lets
    the tokenizer model fall back to the tokenizer's own padding token."""
    value = (manifest.get("model") or {}).get("pad_token_id")
    if value is None:
        try:
            value = json.loads(config_json.read_text()).get("pad_token_id")
        except (OSError, ValueError, AttributeError):
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def _write_tokenizer(model_dir: Path, tokenizer_json: Path, max_batch: int, max_seq_len: int,
                     pad_id: int | None) -> None:
    params = [{"key": "max_seq_len", "value": {"string_value": str(max_seq_len)}}]
    if pad_id is not None:
        params.append({"key": "pad_id", "value": {"string_value": str(pad_id)}})
    _write_config(model_dir, {
        "name": model_dir.name, "backend": "python", "max_batch_size": max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": [{"name": n, "data_type": Enum("TYPE_INT64"), "dims": [-1]}
                   for n in _TOKENIZER_OUTPUTS],
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": 1}],
        "parameters": params,
    }, ["Tokenizer (Triton Python backend): TEXT [batch, 1] -> input_ids, attention_mask",
        "[batch, length], padded to the longest text of a request, truncated to max_seq_len."])
    template = resources.files("mbert.export").joinpath("triton_model.py").read_text("utf-8")
    (model_dir / "1" / "model.py").write_text(template)
    _link_or_copy(tokenizer_json, model_dir / "1" / "tokenizer.json")


def _write_onnx(model_dir: Path, onnx_path: Path, inputs: list[dict], outputs: list[dict],
                max_batch: int, batching: dict[str, Any]) -> None:
    _write_config(model_dir, {
        "name": model_dir.name, "platform": "onnxruntime_onnx", "max_batch_size": max_batch,
        "input": inputs, "output": outputs,
        "instance_group": [{"kind": Enum("KIND_AUTO"), "count": 1}],
        "dynamic_batching": batching,
    }, [f"ONNX Runtime model, from the bundle's {onnx_path.name}. KIND_AUTO: GPU when present,",
        "else CPU. The dynamic batcher merges only requests of equal sequence length."])
    _link_or_copy(onnx_path, model_dir / "1" / "model.onnx")
    for location in _external_data(onnx_path):
        _link_or_copy(onnx_path.parent / location, model_dir / "1" / location)


def _write_trt(model_dir: Path, plan: Path | None, inputs: list[dict], outputs: list[dict],
               max_batch: int, batching: dict[str, Any], profiles: list[Profile]) -> None:
    comments = ["TensorRT engine. A plan runs only with the TensorRT version that built it",
                "(it must match Triton's TensorRT backend), on the GPU architecture it was",
                "built for."]
    comments += [f"optimization profile {i}: (batch, seq) {p}" for i, p in enumerate(profiles)]
    comments += ["Triton picks, per request shape, among the profiles listed in instance_group.",
                 "The dynamic batcher merges only requests of equal sequence length."]
    group: dict[str, Any] = {"kind": Enum("KIND_GPU"), "count": 1,
                             "profile": [str(i) for i in range(len(profiles))]}
    _write_config(model_dir, {
        "name": model_dir.name, "platform": "tensorrt_plan", "max_batch_size": max_batch,
        "input": inputs, "output": outputs, "instance_group": [group],
        "dynamic_batching": batching,
    }, comments)
    if plan is not None:
        _link_or_copy(plan, model_dir / "1" / "model.plan")
    else:
        (model_dir / "1" / "README").write_text(_PENDING_README.format(name=model_dir.name))


def _write_ensemble(model_dir: Path, name: str, target: str, outputs: list[dict],
                    max_batch: int) -> None:
    model = f"{name}_{target}"
    _write_config(model_dir, {
        "name": name, "platform": "ensemble", "max_batch_size": max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": outputs,
        "ensemble_scheduling": {"step": [
            {"model_name": f"{name}_tokenizer", "model_version": -1,
             "input_map": [{"key": "TEXT", "value": "TEXT"}],
             "output_map": [{"key": n, "value": n} for n in _TOKENIZER_OUTPUTS]},
            {"model_name": model, "model_version": -1,
             "input_map": [{"key": n, "value": n} for n in _TOKENIZER_OUTPUTS],
             "output_map": [{"key": t["name"], "value": t["name"]} for t in outputs]},
        ]},
    }, ["Ensemble: TEXT -> tokenizer -> model. To serve the TensorRT engine instead of ONNX",
        f'Runtime, set the second step\'s model_name to "{name}_trt".'])
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
model folder it finds, and one without 1/model.plan fails to load (stopping the server unless it
runs with --exit-on-error=false).

To enable it, on a machine with the serving GPU and the TensorRT version of your Triton release:

1. Build the engine from the bundle's ONNX file, for example:
       from mbert.export.trt_build import build_engine, profiles_from
       build_engine("model.fp16.onnx", "model.plan", profiles_from(MAX_BATCH, MAX_SEQ_LEN))
   (profiles must accept batch 1..max_batch_size of config.pbtxt and the full sequence range),
   or rewrite the repository with write_triton_repository(..., has_plan=True, profiles=...).
2. Or by hand: copy the plan to 1/model.plan here, list the engine's profiles in
   config.pbtxt's instance_group profile field, and move this folder into ../../triton/.
"""


def _readme(name: str, has_plan: bool, target: str) -> str:
    trt = (f"- `{name}_trt/`: TensorRT plan (platform tensorrt_plan, KIND_GPU).\n" if has_plan else
           f"- `{name}_trt` is not here: the bundle has no model.plan yet; see "
           f"`../triton_pending/{name}_trt/1/README`.\n")
    return (f"# Triton model repository for `{name}`\n\n"
            f"Serve with `tritonserver --model-repository=$(pwd)`. Models:\n\n"
            f"- `{name}/`: ensemble, input `TEXT` (TYPE_STRING, [batch, 1]), routed through "
            f"`{name}_tokenizer` to `{name}_{target}`.\n"
            f"- `{name}_tokenizer/`: Python backend; needs the `tokenizers` package in Triton's "
            f"Python environment.\n"
            f"- `{name}_onnx/`: ONNX Runtime.\n{trt}\n"
            f"To route the ensemble to another model, change `model_name` of the second step in "
            f"`{name}/config.pbtxt` to `{name}_onnx` or `{name}_trt`.\n\n"
            "All models batch (max_batch_size > 0): the dynamic batcher merges requests only when "
            "their padded sequence lengths are equal.\n")
