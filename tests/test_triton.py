"""Triton model repository writer: every config.pbtxt parses as Triton's ModelConfig, the ensemble
wiring is consistent, files land where Triton looks, the encoder switch, and the Python models'
plain functions. (The real server loads and serves these repositories in test_triton_serve.py.)"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

from mbert.bundle import Profile  # noqa: E402
from mbert.bundle.errors import BundleError  # noqa: E402
from mbert.bundle.names import TRITON_ONNX, TRITON_PLAN, TRITON_PYTHON  # noqa: E402
from mbert.export.tensorrt.build import profiles_from  # noqa: E402
from mbert.export.triton.pbtxt import Enum, to_pbtxt  # noqa: E402
from mbert.export.triton.writer import TritonSpec, default_buckets, write_triton_repository  # noqa: E402
from mbert.modeling.graph import TensorSpec  # noqa: E402
from mbert.runtime.serve import models as triton_models  # noqa: E402
from mbert.runtime.serve.repository import ensembles, serving_copy, set_ensemble_encoder  # noqa: E402

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


ENCODER_IO = {
    "inputs": (TensorSpec("input_ids", "int64", ("batch", "sequence")),
               TensorSpec("attention_mask", "int64", ("batch", "sequence"))),
    "outputs": (TensorSpec("last_hidden_state", "float32", ("batch", "sequence", HIDDEN)),
                TensorSpec("sentence_embedding", "float32", ("batch", HIDDEN))),
}


def make_spec(**overrides) -> TritonSpec:
    values = dict(name="tiny-embed", max_length=64, pad_id=PAD, max_batch=8, **ENCODER_IO)
    values.update(overrides)
    return TritonSpec(**values)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    for file in ("tokenizer.json", "config.json"):
        shutil.copy(FIXTURES / "modernbert-base" / file, folder / file)
    tiny_onnx(folder / "model.onnx")
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


# --- the spec ------------------------------------------------------------------------------------

def test_spec_normalizes_and_defaults():
    spec = make_spec(inputs=list(ENCODER_IO["inputs"]), profiles=profiles_from(8, 64))
    assert spec.inputs == ENCODER_IO["inputs"] and isinstance(spec.profiles[0], Profile)
    assert spec.length_buckets == (16, 32, 64) == default_buckets(64)
    assert spec.ensemble_outputs == ("sentence_embedding",)  # last_hidden_state only when asked
    assert default_buckets(512) == (16, 32, 64, 128, 256, 512) and default_buckets(10) == (10,)
    assert make_spec(length_buckets=(48, 8)).length_buckets == (8, 48, 64)
    assert make_spec(name="org/My Model").model_name == "org_My_Model"
    with pytest.raises(Exception):
        spec.encoder = "onnx"  # frozen


@pytest.mark.parametrize("change, message", [
    (dict(max_length=0), "max_length"),
    (dict(pad_id=-1), "pad_id"),
    (dict(max_batch=True), "max_batch"),
    (dict(inputs=ENCODER_IO["inputs"][:1]), "tokenizer feeds exactly"),
    (dict(outputs=()), "no outputs"),
    (dict(outputs=(TensorSpec("x", "complex64", ("batch", 3)),)), "dtype"),
    (dict(outputs=(TensorSpec("x", "float32", (1, HIDDEN)),)), "batch axis"),
    (dict(outputs=(TensorSpec("x", "float32", ("batch", 0)),)), "invalid dimension"),
    (dict(outputs=(TensorSpec("truncated", "bool", ("batch", 1)),)), "clash"),
    (dict(encoder="tensorrt"), "encoder must be one of"),
    (dict(encoder="trt"), "needs a bundle with model.plan"),
    (dict(profiles=[Profile((1, 1), (2, 32), (2, 64))]), "every batch size"),
    (dict(profiles=profiles_from(8, 32)), "sequence length"),
    (dict(preferred_batch_sizes=(16,)), "preferred_batch_sizes"),
    (dict(length_buckets=(0, 16)), "length_buckets"),
    (dict(length_buckets=(128,)), "length_buckets"),
    (dict(ensemble_outputs=("logits",)), "subset"),
    (dict(ensemble_outputs=()), "subset"),
])
def test_bad_spec_raises_bundle_error(change, message):
    with pytest.raises(BundleError, match=message):
        make_spec(**change)


# --- the repository ------------------------------------------------------------------------------

BACKEND_FILE = {"python": TRITON_PYTHON, "onnxruntime_onnx": TRITON_ONNX, "tensorrt_plan": TRITON_PLAN}


def backend_of(config) -> str:
    return config.backend or config.platform


def triton_json(config) -> dict:
    """A parsed config as the JSON Triton hands a Python model's ``initialize`` (``model_config``)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def onnx_tensors(path: Path) -> tuple[dict, dict]:
    """The inputs and outputs of an ONNX file as Triton's ONNX Runtime backend checks them against the
    config at load: name -> (Triton type, dims without the batch axis, symbolic as -1)."""
    types = {TensorProto.INT64: DT.TYPE_INT64, TensorProto.FLOAT: DT.TYPE_FP32, TensorProto.FLOAT16: DT.TYPE_FP16}

    def of(values):
        return {v.name: (types[v.type.tensor_type.elem_type],
                         [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim[1:]])
                for v in values}

    graph = onnx.load(str(path), load_external_data=False).graph
    return of(graph.input), of(graph.output)


def test_repository_without_plan_is_what_triton_loads(bundle: Path):
    """Checked against what Triton and the spec require, not against the writer's dicts: every model has
    the file its backend loads, the ONNX models' configs declare their files' tensors, the Python
    models read the spec's settings back from their configs, and the ensemble is wired end to end."""
    spec = make_spec(profiles=profiles_from(8, 64, split_seq=[16]))
    repo = write_triton_repository(bundle, spec)
    assert repo == bundle / "triton"
    configs = all_configs(repo)
    name = spec.model_name
    assert set(configs) == {name, f"{name}_tokenizer", f"{name}_python", f"{name}_onnx"}
    assert {c.max_batch_size for c in configs.values()} == {spec.max_batch}

    for model, config in configs.items():  # the version folder holds what the backend loads by default
        if config.platform == "ensemble":
            assert (repo / model / "1").is_dir()
        else:
            assert (repo / model / "1" / BACKEND_FILE[backend_of(config)]).is_file(), model
    for model in (f"{name}_tokenizer", f"{name}_python"):
        code = (repo / model / "1" / TRITON_PYTHON).read_text()
        assert "from mbert.runtime.serve.models import TritonPythonModel" in code
    assert (repo / f"{name}_tokenizer/1/tokenizer.json").read_bytes() == (bundle / "tokenizer.json").read_bytes()

    for model in (f"{name}_python", f"{name}_onnx"):  # the config declares the graph's own tensors
        assert (repo / model / "1" / TRITON_ONNX).read_bytes() == (bundle / "model.onnx").read_bytes()
        inputs, outputs = onnx_tensors(repo / model / "1" / TRITON_ONNX)
        assert tensors(configs[model].input) == inputs and tensors(configs[model].output) == outputs, model
    assert all(t.allow_ragged_batch for t in configs[f"{name}_python"].input)  # it re-batches rows itself
    assert not any(t.allow_ragged_batch for t in configs[f"{name}_onnx"].input)  # its batcher needs equal shapes

    tok = triton_models.TokenizerModel(triton_json(configs[f"{name}_tokenizer"]), repo / f"{name}_tokenizer" / "1",
                                       pb_utils=None)
    assert (tok.max_length, tok.pad_id, tuple(tok.buckets)) == (spec.max_length, spec.pad_id, spec.length_buckets)
    assert len(tok.text.encode(["tea " * 200])[0].ids) == spec.max_length
    enc = triton_models.EncoderModel(triton_json(configs[f"{name}_python"]), repo / f"{name}_python" / "1",
                                     pb_utils=None)
    assert (enc.max_length, enc.pad_id, enc.batch_size, enc.max_batch_tokens) == \
        (spec.max_length, spec.pad_id, spec.max_batch, spec.batch_tokens)
    assert enc.outputs == [t.name for t in spec.outputs] and enc.per_token == {"last_hidden_state"}

    ensemble = configs[name]
    assert check_ensemble(configs, ensemble) == [f"{name}_tokenizer", f"{name}_python"]
    assert [t.name for t in ensemble.output] == [*spec.ensemble_outputs, "num_tokens", "truncated"]

    # no plan: the TensorRT model waits outside the repository Triton scans, with what it needs to be added
    pending = bundle / "triton_pending" / f"{name}_trt"
    trt = parse(pending / "config.pbtxt")
    assert backend_of(trt) == "tensorrt_plan" and trt.instance_group[0].kind == KIND.KIND_GPU
    assert [int(p) for p in trt.instance_group[0].profile] == list(range(len(spec.profiles)))
    assert tensors(trt.input) == tensors(configs[f"{name}_onnx"].input)
    assert tensors(trt.output) == tensors(configs[f"{name}_onnx"].output)
    assert not (pending / "1" / TRITON_PLAN).exists() and TRITON_PLAN in (pending / "1" / "README").read_text()
    assert "TensorRT-RTX" in (pending / "config.pbtxt").read_text()
    readme = (repo / "README.md").read_text()
    assert "triton_pending" in readme and "mbert-run serve" in readme


def test_repository_with_plan_and_trt_ensemble(bundle: Path):
    (bundle / "model.plan").write_bytes(b"not a real engine")
    profiles = profiles_from(16, 64)
    repo = write_triton_repository(bundle, make_spec(
        has_plan=True, profiles=profiles, max_batch=16, preferred_batch_sizes=(8, 4),
        max_queue_delay_us=100, encoder="trt",
        ensemble_outputs=("sentence_embedding", "last_hidden_state")))
    configs = all_configs(repo)
    assert set(configs) == {"tiny-embed", "tiny-embed_tokenizer", "tiny-embed_python",
                            "tiny-embed_onnx", "tiny-embed_trt"}
    assert not (bundle / "triton_pending").exists()
    trt = configs["tiny-embed_trt"]
    assert trt.platform == "tensorrt_plan"
    assert list(trt.instance_group[0].profile) == ["0"]
    assert list(trt.dynamic_batching.preferred_batch_size) == [4, 8]
    assert trt.dynamic_batching.max_queue_delay_microseconds == 100
    assert (repo / "tiny-embed_trt/1/model.plan").read_bytes() == b"not a real engine"
    assert check_ensemble(configs, configs["tiny-embed"])[-1] == "tiny-embed_trt"
    assert "last_hidden_state" in tensors(configs["tiny-embed"].output)


def test_rewrite_is_deterministic_and_replaces_old_output(bundle: Path):
    (bundle / "model.plan").write_bytes(b"plan")
    spec = make_spec(has_plan=True, max_batch=4)
    write_triton_repository(bundle, spec)
    first = {p.relative_to(bundle): p.read_bytes()
             for p in sorted(bundle.glob("triton*/**/*")) if p.is_file()}
    (bundle / "triton" / "stale.txt").write_text("old")
    write_triton_repository(bundle, spec)
    second = {p.relative_to(bundle): p.read_bytes()
              for p in sorted(bundle.glob("triton*/**/*")) if p.is_file()}
    assert first == second
    assert not [p for p in bundle.iterdir() if p.name.startswith(".triton-")]


def test_fp16_graph_for_the_backend_fp32_for_the_python_encoder(bundle: Path):
    ort = pytest.importorskip("onnxruntime")
    tiny_onnx(bundle / "model.fp16.onnx", external=True)  # stands in for the mixed-precision file
    repo = write_triton_repository(bundle, make_spec(onnx_backend_file="model.fp16.onnx"))
    version = repo / "tiny-embed_onnx" / "1"
    assert (version / "model.fp16.onnx.data").is_file()
    assert (repo / "tiny-embed_python/1/model.onnx").read_bytes() == \
        (bundle / "model.onnx").read_bytes()
    # the copied model loads from the repository folder with its external weights
    session = ort.InferenceSession(str(version / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    ids = np.array([[CLS, 5, SEP]], dtype=np.int64)
    hidden, pooled = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert hidden.shape == (1, 3, HIDDEN) and pooled.shape == (1, HIDDEN)


def test_head_outputs_logits(bundle: Path):
    spec = make_spec(name="org/clf", outputs=(TensorSpec("logits", "float32", ("batch", 3)),))
    configs = all_configs(write_triton_repository(bundle, spec))
    assert set(configs) == {"org_clf", "org_clf_tokenizer", "org_clf_python", "org_clf_onnx"}
    assert tensors(configs["org_clf"].output) == {"logits": (DT.TYPE_FP32, [3]),
                                                  "num_tokens": (DT.TYPE_INT64, [1]),
                                                  "truncated": (DT.TYPE_BOOL, [1])}
    check_ensemble(configs, configs["org_clf"])


def test_missing_files_raise_bundle_error(bundle: Path):
    with pytest.raises(BundleError, match="model.plan"):
        write_triton_repository(bundle, make_spec(has_plan=True))
    with pytest.raises(BundleError, match="model.fp16.onnx"):
        write_triton_repository(bundle, make_spec(onnx_backend_file="model.fp16.onnx"))
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json"):
        write_triton_repository(bundle, make_spec())
    assert not (bundle / "triton").exists()


# --- switching the encoder -----------------------------------------------------------------------

def test_switch_encoder_without_reexport(bundle: Path):
    repo = write_triton_repository(bundle, make_spec())
    ensemble = repo / "tiny-embed" / "config.pbtxt"
    assert ensembles(repo) == {"tiny-embed": ["tiny-embed_tokenizer", "tiny-embed_python"]}
    assert set_ensemble_encoder(repo, "onnx") == [ensemble]
    configs = all_configs(repo)
    assert check_ensemble(configs, configs["tiny-embed"])[-1] == "tiny-embed_onnx"
    assert ensemble.read_text().startswith("# Ensemble: TEXT -> tokenizer -> encoder.")
    assert set_ensemble_encoder(repo, "onnx") == []  # already there
    with pytest.raises(BundleError, match="no model tiny-embed_trt .*no model.plan"):
        set_ensemble_encoder(repo, "trt")
    with pytest.raises(BundleError, match="encoder must be one of"):
        set_ensemble_encoder(repo, "tensorrt")
    # a target lacking a tensor the ensemble maps is refused, and nothing changes
    onnx_cfg = repo / "tiny-embed_python" / "config.pbtxt"
    onnx_cfg.write_text(onnx_cfg.read_text().replace('"sentence_embedding"', '"pooled"'))
    before = ensemble.read_text()
    with pytest.raises(BundleError, match=r"lacks tensors \['sentence_embedding'\]"):
        set_ensemble_encoder(repo, "python")
    assert ensemble.read_text() == before


# --- the Python models' plain functions ------------------------------------------------------------

def test_package_never_imports_the_template():
    import mbert.export.triton.writer  # noqa: F401

    assert "mbert.export.triton.model_template" not in sys.modules


def test_decode_texts_names_the_bad_row():
    texts = np.array([["tea".encode()], ["thé".encode()]], dtype=object)
    assert triton_models.decode_texts(texts) == ["tea", "thé"]
    assert triton_models.decode_texts(np.array([[b"a"], [b""]], dtype=object)) == ["a", ""]  # embedded as [CLS] [SEP]
    with pytest.raises(ValueError, match=r"TEXT\[1\] is int, expected UTF-8 bytes"):
        triton_models.decode_texts(np.array([[b"a"], [5]], dtype=object))
    with pytest.raises(ValueError, match=r"TEXT\[0\] is not valid UTF-8 \(invalid start byte at byte 2\)"):
        triton_models.decode_texts(np.array([[b"ab\xff"]], dtype=object))


def test_bucket_length_and_row_lengths():
    assert [triton_models.bucket_length(n, [16, 32, 64]) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    ids = np.zeros((2, 4), dtype=np.int64)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert triton_models.row_lengths(ids, mask, 4).tolist() == [2, 4]
    for bad, message in [([[1, 0, 1, 0], [1, 1, 1, 1]], "row 0 must be"),
                         ([[1, 1, 0, 0], [0, 0, 0, 0]], "row 1 must be")]:
        with pytest.raises(ValueError, match=message):
            triton_models.row_lengths(ids, np.array(bad), 4)
    with pytest.raises(ValueError, match="row 1 must be 1 to 3 ones"):
        triton_models.row_lengths(ids, mask, 3)
    with pytest.raises(ValueError, match="equal"):
        triton_models.row_lengths(ids, mask[:, :3], 4)


def test_serving_copy_switches_the_encoder_and_leaves_the_bundle_alone(bundles, tmp_path: Path):
    """``mbert-run serve --encoder``: the server runs on a copy of the opened bundle's repository whose
    ensemble routes elsewhere; the sealed bundle is untouched, and the copy's large files are hard
    links to the files that were verified."""
    from mbert.bundle import open_bundle

    opened = open_bundle(bundles.bundle("mean"))
    repo, name = opened.path / opened.manifest.triton.repository, opened.manifest.triton.ensemble
    before = {p: p.read_bytes() for p in opened.path.rglob("*") if p.is_file()}
    copy = serving_copy(opened, "onnx", tmp_path / "serve")
    assert ensembles(copy)[name][-1] == f"{name}_onnx"
    assert ensembles(repo)[name][-1] == f"{name}_python"
    assert {p: p.read_bytes() for p in opened.path.rglob("*") if p.is_file()} == before
    onnx_copy = copy / f"{name}_onnx" / "1" / TRITON_ONNX
    assert onnx_copy.stat().st_ino == (repo / f"{name}_onnx" / "1" / TRITON_ONNX).stat().st_ino
    with pytest.raises(BundleError, match=f"no model {name}_trt"):
        serving_copy(opened, "trt", tmp_path / "serve2")


def test_serve_command_refuses_what_is_not_a_verified_bundle(bundle: Path, tmp_path: Path):
    from click.testing import CliRunner

    from mbert.runtime.cli.serve import serve

    write_triton_repository(bundle, make_spec())
    result = CliRunner().invoke(serve, [str(bundle)])  # a repository, but no sealed manifest
    assert result.exit_code == 1 and "no manifest.json" in result.output
    result = CliRunner().invoke(serve, [str(tmp_path / "nope")])
    assert result.exit_code == 1 and "no such bundle folder" in result.output
