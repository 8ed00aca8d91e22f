"""The model folders of a Triton repository (written by :mod:`mbert.export.triton.writer`): config.pbtxt of
each model, the Python models' ``model.py`` shim, the graphs and plan (hard-linked), and READMEs."""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle.errors import BundleError
from mbert.bundle.files import link_or_copy
from mbert.bundle.names import TOKENIZER, TRITON_CONFIG, TRITON_ONNX, TRITON_PLAN, TRITON_PYTHON
from mbert.bundle.tensors import INPUT_NAMES, TensorSpec
from mbert.export.triton.pbtxt import Enum, to_pbtxt
from mbert.export.triton.spec import _TYPES, TOKENIZER_EXTRA, TritonSpec, dims


def triton_tensor(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "data_type": Enum(_TYPES[t.dtype]), "dims": dims(t)}


def _write_config(model_dir: Path, config: dict[str, Any], comments: Sequence[str] = ()) -> None:
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / TRITON_CONFIG).write_text(to_pbtxt(config, comments))


def _params(**values: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"string_value": str(v)}} for k, v in values.items()]


def _batching(spec: TritonSpec) -> dict[str, Any]:
    return {"preferred_batch_size": list(spec.preferred_batch_sizes) or None,
            "max_queue_delay_microseconds": spec.max_queue_delay_us or None}


def _copy_model_py(model_dir: Path) -> None:
    template = resources.files("mbert.export.triton").joinpath("model_template.py").read_text("utf-8")
    (model_dir / "1" / TRITON_PYTHON).write_text(template)


def _tokenizer_outputs() -> list[dict[str, Any]]:
    return ([{"name": n, "data_type": Enum("TYPE_INT64"), "dims": [-1]} for n in INPUT_NAMES]
            + [{"name": n, "data_type": Enum(t), "dims": [1]} for n, t in TOKENIZER_EXTRA])


def tokenizer(model_dir: Path, tokenizer_json: Path, spec: TritonSpec) -> None:
    _write_config(model_dir, {
        "name": model_dir.name, "backend": "python", "max_batch_size": spec.max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": _tokenizer_outputs(),
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": 1}],
        "dynamic_batching": {},
        "parameters": _params(role="tokenizer", max_length=spec.max_length, pad_id=spec.pad_id,
                              length_buckets=",".join(map(str, spec.length_buckets))),
    }, ["Tokenizer (Python backend; code in mbert.runtime.serve.models): TEXT [batch, 1] UTF-8",
        "-> input_ids, attention_mask [batch, length] (truncated to max_length as mbert.runtime",
        "truncates; padded to the smallest length bucket holding the request's longest text),",
        "num_tokens [batch, 1] (tokens kept) and truncated [batch, 1] (the text was cut).",
        "A non-UTF-8 text fails its request with an error naming the row; an empty text is embedded",
        "as [CLS] [SEP], as mbert.runtime embeds it."])
    _copy_model_py(model_dir)
    link_or_copy(tokenizer_json, model_dir / "1" / TOKENIZER)


def python_encoder(model_dir: Path, onnx_path: Path, spec: TritonSpec) -> None:
    inputs = [dict(triton_tensor(t), allow_ragged_batch=True) for t in spec.inputs]
    _write_config(model_dir, {
        "name": model_dir.name, "backend": "python", "max_batch_size": spec.max_batch,
        "input": inputs, "output": [triton_tensor(t) for t in spec.outputs],
        "instance_group": [{"kind": Enum("KIND_CPU"), "count": 1}],
        "dynamic_batching": _batching(spec),
        "parameters": _params(role="encoder", onnx_file=TRITON_ONNX, max_length=spec.max_length,
                              pad_id=spec.pad_id, batch_size=spec.max_batch,
                              max_batch_tokens=spec.batch_tokens),
    }, [f"ONNX Runtime (CPU) inside the Python backend, on the bundle's {onnx_path.name}; needs",
        "only Triton's Python backend. allow_ragged_batch: requests of any length share a batch;",
        "the model strips their padding and re-batches all rows with mbert.runtime's",
        "length-sorted token-budget batching (batch_size rows, max_batch_tokens padded tokens)."])
    _copy_model_py(model_dir)
    _link_onnx(onnx_path, model_dir / "1")


def onnx_model(model_dir: Path, onnx_path: Path, spec: TritonSpec) -> None:
    _write_config(model_dir, {
        "name": model_dir.name, "platform": "onnxruntime_onnx", "max_batch_size": spec.max_batch,
        "input": [triton_tensor(t) for t in spec.inputs], "output": [triton_tensor(t) for t in spec.outputs],
        "instance_group": [{"kind": Enum("KIND_AUTO"), "count": 1}],
        "dynamic_batching": _batching(spec),
    }, [f"ONNX Runtime backend, from the bundle's {onnx_path.name}. KIND_AUTO: GPU when present,",
        "else CPU. The dynamic batcher merges requests of equal padded length (the tokenizer",
        "pads to length buckets)."])
    _link_onnx(onnx_path, model_dir / "1")


def _link_onnx(onnx_path: Path, version_dir: Path) -> None:
    link_or_copy(onnx_path, version_dir / TRITON_ONNX)
    for location in _external_data(onnx_path):
        link_or_copy(onnx_path.parent / location, version_dir / location)


def trt_model(model_dir: Path, plan: Path | None, spec: TritonSpec) -> None:
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
        "input": [triton_tensor(t) for t in spec.inputs], "output": [triton_tensor(t) for t in spec.outputs],
        "instance_group": [group], "dynamic_batching": _batching(spec),
    }, comments)
    if plan is not None:
        link_or_copy(plan, model_dir / "1" / TRITON_PLAN)
    else:
        (model_dir / "1" / "README").write_text(_PENDING_README.format(name=model_dir.name))


def ensemble(model_dir: Path, spec: TritonSpec) -> None:
    name = spec.model_name
    outputs = [triton_tensor(t) for t in spec.outputs if t.name in spec.ensemble_outputs]
    extra = [{"name": n, "data_type": Enum(t), "dims": [1]} for n, t in TOKENIZER_EXTRA]
    _write_config(model_dir, {
        "name": name, "platform": "ensemble", "max_batch_size": spec.max_batch,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": outputs + extra,
        "ensemble_scheduling": {"step": [
            {"model_name": f"{name}_tokenizer", "model_version": -1,
             "input_map": [{"key": "TEXT", "value": "TEXT"}],
             "output_map": [{"key": n, "value": n}
                            for n in INPUT_NAMES + tuple(n for n, _ in TOKENIZER_EXTRA)]},
            {"model_name": f"{name}_{spec.encoder}", "model_version": -1,
             "input_map": [{"key": n, "value": n} for n in INPUT_NAMES],
             "output_map": [{"key": t["name"], "value": t["name"]} for t in outputs]},
        ]},
    }, ["Ensemble: TEXT -> tokenizer -> encoder. The second step's model_name picks the encoder:",
        f'"{name}_python" (ONNX Runtime in the Python backend, CPU), "{name}_onnx" (ONNX Runtime',
        f'backend) or "{name}_trt" (TensorRT).',
        "Switch without re-exporting: mbert-run serve BUNDLE --encoder onnx (serves a private copy),",
        "or edit this model_name in a copy of the repository you deploy."])
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


def readme(spec: TritonSpec) -> str:
    name = spec.model_name
    trt = (f"- `{name}_trt/`: TensorRT plan (platform tensorrt_plan, KIND_GPU).\n"
           if spec.has_plan else
           f"- `{name}_trt` is not here: {spec.no_plan_reason}; see "
           f"`../triton_pending/{name}_trt/1/README`.\n")
    return (f"# Triton model repository for `{name}`\n\n"
            f"Serve on CPU with `mbert-run serve BUNDLE` (starts `tritonserver` on this folder).\n"
            f"Models:\n\n"
            f"- `{name}/`: ensemble, input `TEXT` (TYPE_STRING, [batch, 1], UTF-8), outputs "
            f"{', '.join(f'`{n}`' for n in spec.ensemble_outputs)}, `num_tokens`, `truncated`; "
            f"routed through `{name}_tokenizer` to `{name}_{spec.encoder}`.\n"
            f"- `{name}_tokenizer/`: Python backend (code in `mbert.runtime.serve.models`).\n"
            f"- `{name}_python/`: ONNX Runtime on CPU inside the Python backend; needs only "
            f"the Python backend.\n"
            f"- `{name}_onnx/`: ONNX Runtime backend (NVIDIA's Triton containers have it).\n{trt}\n"
            "The Python models need `mbert-export` in Triton's Python environment (`mbert-run "
            "serve` uses the Python it runs in; in a container: `pip install "
            "'mbert-export[cpu]'`).\n\n"
            f"To route the ensemble to another encoder, run `mbert-run serve BUNDLE --encoder "
            f"onnx|trt|python` (it serves a private copy; the bundle is sealed), or, in a copy of this "
            f"repository you deploy, change `model_name` of the second step in "
            f"`{name}/config.pbtxt` to `{name}_python`, `{name}_onnx` or `{name}_trt`.\n\n"
            f"Batching: the tokenizer pads each request to a length bucket "
            f"({', '.join(map(str, spec.length_buckets))}), so the ONNX Runtime and TensorRT "
            f"batchers merge requests within a bucket; the Python encoder merges requests of any "
            f"length and re-batches their rows by length and token budget.\n")
