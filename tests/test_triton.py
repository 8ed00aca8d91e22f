"""Triton model repository writer: every config.pbtxt parses as Triton's ModelConfig, the ensemble
wiring is consistent, files land where Triton looks, and the tokenizer model.py works."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import json_format, text_format
from onnx import TensorProto, helper, numpy_helper

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

from mbert.bundle import Profile  # noqa: E402
from mbert.export.trt_build import profiles_from  # noqa: E402
from mbert.export.triton import Enum, to_pbtxt, write_triton_repository  # noqa: E402
from mbert.modeling.errors import BundleError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
HIDDEN = 8
TEA_IDS = [50281, 1147, 434, 673, 323, 10331, 15, 50282]
CLS, SEP, PAD = 50281, 50282, 50283


def tiny_onnx(path: Path, *, external: bool = False) -> None:
    """input_ids/attention_mask int64 [b, s] -> last_hidden_state [b, s, 8] (masked embedding
    lookup), sentence_embedding [b, 8] (mean over the sequence)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((64, HIDDEN)).astype(np.float32), "table")
    consts = [numpy_helper.from_array(np.array(64, dtype=np.int64), "vocab"),
              numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis")]
    nodes = [
        helper.make_node("Mod", ["input_ids", "vocab"], ["ids"]),
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_3d"]),
        helper.make_node("Mul", ["emb", "mask_3d"], ["last_hidden_state"]),
        helper.make_node("ReduceMean", ["last_hidden_state"], ["sentence_embedding"], axes=[1],
                         keepdims=0),
    ]
    ids = ["batch", "sequence"]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ids)],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ids + [HIDDEN]),
         helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT,
                                       ["batch", HIDDEN])],
        [table, *consts])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=256)
    else:
        onnx.save(model, str(path))


def io_entry(name: str, dtype: str, shape: list) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape}


def encoder_manifest(name: str = "tiny-embed", max_seq_len: int = 64) -> dict:
    return {
        "name": name, "max_seq_len": max_seq_len, "task": "encoder",
        "pooling": {"mode": "mean", "normalize": False},
        "io": {"inputs": [io_entry("input_ids", "int64", ["batch", "sequence"]),
                          io_entry("attention_mask", "int64", ["batch", "sequence"])],
               "outputs": [io_entry("last_hidden_state", "float32",
                                    ["batch", "sequence", HIDDEN]),
                           io_entry("sentence_embedding", "float32", ["batch", HIDDEN])]},
    }


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    for file in ("tokenizer.json", "config.json"):
        shutil.copy(FIXTURES / "modernbert-base" / file, folder / file)
    tiny_onnx(folder / "model.onnx")
    (folder / "manifest.json").write_text(json.dumps(encoder_manifest()))
    return folder


def parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def all_configs(root: Path) -> dict[str, object]:
    configs = {}
    for path in sorted(root.glob("*/config.pbtxt")):
        config = parse(path)
        assert config.name == path.parent.name, "Triton requires name == folder name"
        configs[config.name] = config
    return configs


DT = model_config_pb2.DataType
KIND = model_config_pb2.ModelInstanceGroup.Kind


def tensors(entries) -> dict[str, tuple[int, list[int]]]:
    return {t.name: (t.data_type, list(t.dims)) for t in entries}


def check_ensemble(configs: dict, ensemble) -> list[str]:
    """Every ensemble input is consumed, every step input is produced before it is used, every
    map key is a real tensor of the step's model with the same type and dims, and every ensemble
    output is produced. Returns the step model names."""
    available = tensors(ensemble.input)
    used = set()
    steps = []
    for step in ensemble.ensemble_scheduling.step:
        assert step.model_name in configs, f"ensemble step uses unknown model {step.model_name}"
        model = configs[step.model_name]
        assert model.max_batch_size >= ensemble.max_batch_size
        model_inputs, model_outputs = tensors(model.input), tensors(model.output)
        assert set(step.input_map) == set(model_inputs), "every model input must be fed"
        for key, value in step.input_map.items():
            assert value in available, f"{value} is used before it is produced"
            assert available[value] == model_inputs[key], f"type/dims mismatch on {key}"
            used.add(value)
        for key, value in step.output_map.items():
            assert key in model_outputs, f"{step.model_name} has no output {key}"
            available[value] = model_outputs[key]
        steps.append(step.model_name)
    assert used >= set(tensors(ensemble.input)), "an ensemble input is never used"
    for name, spec in tensors(ensemble.output).items():
        assert available.get(name) == spec, f"ensemble output {name} is not produced as declared"
    return steps


def load_model_py(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("copied_triton_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the pbtxt writer ----------------------------------------------------------------------------

def test_pbtxt_writer_roundtrip_and_escaping():
    text = to_pbtxt({
        "name": 'we"ird\\name\n', "platform": "ensemble", "max_batch_size": 4,
        "input": [{"name": "TEXT", "data_type": Enum("TYPE_STRING"), "dims": [1]}],
        "output": [], "optimization": None, "dynamic_batching": {},
        "parameters": [{"key": "k", "value": {"string_value": "tab\there"}}],
    }, ["a comment", "second line"])
    assert text.startswith("# a comment\n# second line\n")
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.name == 'we"ird\\name\n'
    assert config.input[0].data_type == DT.TYPE_STRING
    assert config.HasField("dynamic_batching") and not config.HasField("optimization")
    assert config.parameters["k"].string_value == "tab\there"


# --- the repository ------------------------------------------------------------------------------

def test_repository_without_plan(bundle: Path):
    manifest = json.loads((bundle / "manifest.json").read_text())
    profiles = profiles_from(8, 64, split_seq=[16])
    repo = write_triton_repository(bundle, manifest, has_plan=False, profiles=profiles,
                                   max_batch=8)
    assert repo == bundle / "triton"
    configs = all_configs(repo)
    assert set(configs) == {"tiny-embed", "tiny-embed_tokenizer", "tiny-embed_onnx"}

    tok = configs["tiny-embed_tokenizer"]
    assert tok.backend == "python" and not tok.platform and tok.max_batch_size == 8
    assert tensors(tok.input) == {"TEXT": (DT.TYPE_STRING, [1])}
    assert tensors(tok.output) == {"input_ids": (DT.TYPE_INT64, [-1]),
                                   "attention_mask": (DT.TYPE_INT64, [-1])}
    assert tok.instance_group[0].kind == KIND.KIND_CPU
    assert tok.parameters["max_seq_len"].string_value == "64"
    assert tok.parameters["pad_id"].string_value == str(PAD)  # from config.json pad_token_id
    manifest["model"] = {"pad_token_id": 7}  # the manifest's model record wins
    write_triton_repository(bundle, manifest, has_plan=False, profiles=profiles, max_batch=8)
    tok = parse(repo / "tiny-embed_tokenizer" / "config.pbtxt")
    assert tok.parameters["pad_id"].string_value == "7"
    assert (repo / "tiny-embed_tokenizer/1/model.py").is_file()
    assert (repo / "tiny-embed_tokenizer/1/tokenizer.json").read_bytes() == \
        (bundle / "tokenizer.json").read_bytes()

    onnx_cfg = configs["tiny-embed_onnx"]
    assert onnx_cfg.platform == "onnxruntime_onnx" and onnx_cfg.max_batch_size == 8
    assert tensors(onnx_cfg.input) == {"input_ids": (DT.TYPE_INT64, [-1]),
                                       "attention_mask": (DT.TYPE_INT64, [-1])}
    assert tensors(onnx_cfg.output) == {"last_hidden_state": (DT.TYPE_FP32, [-1, HIDDEN]),
                                        "sentence_embedding": (DT.TYPE_FP32, [HIDDEN])}
    assert onnx_cfg.instance_group[0].kind == KIND.KIND_AUTO
    assert onnx_cfg.HasField("dynamic_batching")
    assert not onnx_cfg.dynamic_batching.preferred_batch_size
    assert (repo / "tiny-embed_onnx/1/model.onnx").read_bytes() == \
        (bundle / "model.onnx").read_bytes()

    ensemble = configs["tiny-embed"]
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 8
    assert tensors(ensemble.input) == {"TEXT": (DT.TYPE_STRING, [1])}
    assert check_ensemble(configs, ensemble) == ["tiny-embed_tokenizer", "tiny-embed_onnx"]
    assert (repo / "tiny-embed" / "1").is_dir()

    # no plan: the TensorRT model is written outside the repository Triton scans
    pending = bundle / "triton_pending" / "tiny-embed_trt"
    trt = parse(pending / "config.pbtxt")
    assert trt.platform == "tensorrt_plan" and trt.max_batch_size == 8
    assert trt.instance_group[0].kind == KIND.KIND_GPU
    assert list(trt.instance_group[0].profile) == ["0", "1"]
    assert tensors(trt.input) == tensors(onnx_cfg.input)
    assert tensors(trt.output) == tensors(onnx_cfg.output)
    assert "model.plan" in (pending / "1" / "README").read_text()
    assert "optimization profile 1: (batch, seq) min=(1, 17)" in \
        (pending / "config.pbtxt").read_text()
    assert not (pending / "1" / "model.plan").exists()
    assert "triton_pending" in (repo / "README.md").read_text()


def test_repository_with_plan_and_trt_ensemble(bundle: Path):
    (bundle / "model.plan").write_bytes(b"not a real engine")
    manifest = json.loads((bundle / "manifest.json").read_text())
    profiles = profiles_from(16, 64)
    repo = write_triton_repository(bundle, manifest, has_plan=True, profiles=profiles,
                                   max_batch=16, preferred_batch_sizes=[8, 4],
                                   max_queue_delay_us=100, ensemble_target="trt")
    configs = all_configs(repo)
    assert set(configs) == {"tiny-embed", "tiny-embed_tokenizer", "tiny-embed_onnx",
                            "tiny-embed_trt"}
    assert not (bundle / "triton_pending").exists()
    trt = configs["tiny-embed_trt"]
    assert trt.platform == "tensorrt_plan"
    assert list(trt.instance_group[0].profile) == ["0"]
    assert list(trt.dynamic_batching.preferred_batch_size) == [4, 8]
    assert trt.dynamic_batching.max_queue_delay_microseconds == 100
    assert (repo / "tiny-embed_trt/1/model.plan").read_bytes() == b"not a real engine"
    assert check_ensemble(configs, configs["tiny-embed"])[-1] == "tiny-embed_trt"


def test_rewrite_is_deterministic_and_replaces_old_output(bundle: Path):
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "model.plan").write_bytes(b"plan")
    write_triton_repository(bundle, manifest, has_plan=True, max_batch=4)
    first = {p.relative_to(bundle): p.read_bytes()
             for p in sorted(bundle.glob("triton*/**/*")) if p.is_file()}
    (bundle / "triton" / "stale.txt").write_text("old")
    write_triton_repository(bundle, manifest, has_plan=True, max_batch=4)
    second = {p.relative_to(bundle): p.read_bytes()
              for p in sorted(bundle.glob("triton*/**/*")) if p.is_file()}
    assert first == second
    assert not [p for p in bundle.iterdir() if p.name.startswith(".triton-")]


def test_fp16_onnx_preferred_and_external_data_copied(bundle: Path):
    ort = pytest.importorskip("onnxruntime")
    tiny_onnx(bundle / "model.fp16.onnx", external=True)  # stands in for the mixed-precision file
    manifest = json.loads((bundle / "manifest.json").read_text())
    repo = write_triton_repository(bundle, manifest, has_plan=False, max_batch=4)
    version = repo / "tiny-embed_onnx" / "1"
    assert (version / "model.fp16.onnx.data").is_file()
    # the copied model loads from the repository folder with its external weights
    session = ort.InferenceSession(str(version / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    ids = np.array([[CLS, 5, SEP]], dtype=np.int64)
    hidden, pooled = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert hidden.shape == (1, 3, HIDDEN) and pooled.shape == (1, HIDDEN)


def test_head_manifest_outputs_logits(bundle: Path):
    manifest = encoder_manifest("org/clf")
    manifest["task"], manifest["pooling"] = "sequence-classification", None
    manifest["io"]["outputs"] = [io_entry("logits", "float32", ["batch", 3])]
    repo = write_triton_repository(bundle, manifest, has_plan=False, max_batch=2)
    configs = all_configs(repo)
    assert set(configs) == {"org_clf", "org_clf_tokenizer", "org_clf_onnx"}
    assert tensors(configs["org_clf"].output) == {"logits": (DT.TYPE_FP32, [3])}
    check_ensemble(configs, configs["org_clf"])


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("max_seq_len"), "max_seq_len"),
    (lambda m: m["io"]["inputs"].pop(), "tokenizer"),
    (lambda m: m["io"]["outputs"][0].update(dtype="complex64"), "dtype"),
    (lambda m: m["io"]["outputs"][1].update(shape=[1, HIDDEN]), "batch axis"),
])
def test_bad_manifest_raises_bundle_error(bundle: Path, change, message):
    manifest = encoder_manifest()
    change(manifest)
    with pytest.raises(BundleError, match=message):
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4)


def test_bad_arguments_raise_bundle_error(bundle: Path):
    manifest = encoder_manifest()
    with pytest.raises(BundleError, match="model.plan"):
        write_triton_repository(bundle, manifest, has_plan=True, max_batch=4)
    with pytest.raises(BundleError, match="needs a bundle with model.plan"):
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4,
                                ensemble_target="trt")
    with pytest.raises(BundleError, match="every batch size"):  # engine max batch < Triton's
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4,
                                profiles=[Profile((1, 1), (2, 32), (2, 64))])
    with pytest.raises(BundleError, match="sequence length"):
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4,
                                profiles=profiles_from(4, 32))
    with pytest.raises(BundleError, match="preferred_batch_sizes"):
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4,
                                preferred_batch_sizes=[8])
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json"):
        write_triton_repository(bundle, manifest, has_plan=False, max_batch=4)
    assert not (bundle / "triton").exists()


# --- the tokenizer model -------------------------------------------------------------------------

@pytest.fixture
def copied_model_py(bundle: Path) -> types.ModuleType:
    manifest = json.loads((bundle / "manifest.json").read_text())
    repo = write_triton_repository(bundle, manifest, has_plan=False, max_batch=4)
    assert "triton_python_backend_utils" not in sys.modules
    return load_model_py(repo / "tiny-embed_tokenizer" / "1" / "model.py")


def test_package_never_imports_the_template():
    import mbert.export.triton  # noqa: F401

    assert "mbert.export.triton_model" not in sys.modules


@pytest.mark.parametrize("fixture", ["modernbert-base", "gte-modernbert-base"])
def test_tokenize_batch(copied_model_py, fixture):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(FIXTURES / fixture / "tokenizer.json"))
    assert copied_model_py.resolve_pad_id(tokenizer) == PAD
    ids, mask = copied_model_py.tokenize_batch(tokenizer, ["It's time for tea."], 64, PAD)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.tolist() == [TEA_IDS] and mask.tolist() == [[1] * 8]

    ids, mask = copied_model_py.tokenize_batch(
        tokenizer, ["It's time for tea.", "", "The quick brown fox jumps over the lazy dog."],
        64, PAD)
    assert ids.shape == (3, 12)
    assert ids[0].tolist() == TEA_IDS + [PAD] * 4 and mask[0].tolist() == [1] * 8 + [0] * 4
    assert ids[1].tolist() == [CLS, SEP] + [PAD] * 10 and mask[1].sum() == 2
    assert mask[2].tolist() == [1] * 12 and ids[2, -1] == SEP

    ids, mask = copied_model_py.tokenize_batch(tokenizer, ["It's time for tea."], 5, PAD)
    assert ids.tolist() == [TEA_IDS[:4] + [SEP]] and mask.tolist() == [[1] * 5]


def test_triton_python_model_execute(copied_model_py, bundle: Path):
    """Drive initialize/execute/finalize with a stand-in for triton_python_backend_utils."""
    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class Response:
        def __init__(self, output_tensors, error=None):
            self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
            self.error = error

    class Request:
        def __init__(self, texts):
            self.inputs = {"TEXT": Tensor("TEXT", np.array([[t.encode()] for t in texts],
                                                           dtype=object))}

    stub = types.SimpleNamespace(
        Tensor=Tensor, InferenceResponse=Response, TritonError=lambda msg: msg,
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name))
    copied_model_py.pb_utils = stub
    config = parse(bundle / "triton" / "tiny-embed_tokenizer" / "config.pbtxt")
    model = copied_model_py.TritonPythonModel()
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(
        config, preserving_proto_field_name=True))})
    assert model.max_len == 64 and model.pad_id == PAD
    ok, broken = model.execute([Request(["It's time for tea.", "tea"]), object()])
    assert ok.error is None
    assert ok.outputs["input_ids"][0].tolist() == TEA_IDS
    assert ok.outputs["attention_mask"].shape == (2, 8)
    ids, mask = ok.outputs["input_ids"][1], ok.outputs["attention_mask"][1]
    assert ids[mask == 0].tolist() == [PAD] * int((mask == 0).sum()) and 0 < mask.sum() < 8
    assert broken.error and "tokenization failed" in broken.error
    model.finalize()
