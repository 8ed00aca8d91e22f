"""mbert.export.tensorrt: profile logic (pure Python), build_engine's use of the TensorRT API
(against a stand-in module that follows the documented 10.x / 11.x Python API), and real engine
builds compared with ONNX Runtime where TensorRT and a GPU are present."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from mbert.bundle import Profile
from mbert.export import tensorrt as mtrt
from mbert.runtime.tensorrt import TensorRTRunner, select_profile
from mbert.export.tensorrt import (
    build_engine,
    profiles_from,
    tensorrt_available,
)
from mbert.modeling.errors import EngineError

TRT_OK, TRT_REASON = tensorrt_available()
HIDDEN = 8


# --- Profile / profiles_from / select_profile ------------------------------------------------

def test_profile_accepts_valid_and_normalises_to_tuples():
    profile = Profile([1, 1], (4, np.int64(128)), (8, 512))
    assert profile.opt == (4, 128) and isinstance(profile.min, tuple)
    assert profile.covers(1, 1) and profile.covers(8, 512) and not profile.covers(9, 10)
    assert str(profile) == "min=(1, 1) opt=(4, 128) max=(8, 512)"


@pytest.mark.parametrize("args", [
    ((0, 1), (1, 1), (1, 1)),          # zero batch
    ((1, 1), (1, 0), (1, 1)),          # zero sequence
    ((2, 1), (1, 1), (4, 4)),          # min > opt
    ((1, 1), (8, 8), (4, 4)),          # opt > max
    ((1, 1, 1), (1, 1), (1, 1)),       # not a pair
    ((1.5, 1), (2, 2), (3, 3)),        # not ints
    ((True, 1), (2, 2), (3, 3)),       # bool is not a size
    ("11", (2, 2), (3, 3)),
])
def test_profile_validation_raises_value_error(args):
    with pytest.raises(ValueError):
        Profile(*args)


def test_profiles_from_default_is_one_profile():
    (profile,) = profiles_from(32, 8192)
    assert profile == Profile((1, 1), (16, 512), (32, 8192))
    (small,) = profiles_from(1, 128)
    assert small == Profile((1, 1), (1, 128), (1, 128))
    (custom,) = profiles_from(8, 1024, opt_batch=2, opt_seq_len=300)
    assert custom.opt == (2, 300)


@pytest.mark.parametrize("split", [[512, 8192], [512]])
def test_profiles_from_split_covers_contiguous_ranges(split):
    short, long = profiles_from(16, 8192, split_seq=split)
    assert (short.min, short.max) == ((1, 1), (16, 512))
    assert (long.min, long.max) == ((1, 513), (16, 8192))
    assert short.opt == (8, 512) and long.opt == (8, 4096)
    for seq in (1, 512, 513, 8192):
        assert sum(p.covers(16, seq) for p in (short, long)) == 1


def test_profiles_from_clamps_opt_seq_into_each_range():
    profiles = profiles_from(4, 2048, opt_seq_len=100, split_seq=[64, 1024])
    assert [p.opt[1] for p in profiles] == [64, 100, 1025]


@pytest.mark.parametrize("kwargs", [
    dict(max_batch=0, max_seq_len=8), dict(max_batch=2, max_seq_len=0),
    dict(max_batch=2, max_seq_len=8, opt_batch=3), dict(max_batch=2, max_seq_len=8, opt_seq_len=9),
    dict(max_batch=2, max_seq_len=8, split_seq=[4, 2]), dict(max_batch=2, max_seq_len=8,
                                                           split_seq=[4, 4]),
    dict(max_batch=2, max_seq_len=8, split_seq=[16]), dict(max_batch=2, max_seq_len=8,
                                                           split_seq=[0, 4]),
])
def test_profiles_from_rejects_bad_arguments(kwargs):
    with pytest.raises(EngineError):
        profiles_from(**kwargs)


def test_select_profile_names_shape_and_profiles():
    profiles = profiles_from(4, 64, split_seq=[16])
    assert select_profile(profiles, 1, 16) == 0 and select_profile(profiles, 4, 17) == 1
    pattern = r"\(batch=5, seq=10\).*#0: min=\(1, 1\).*#1: min=\(1, 17\)"
    with pytest.raises(EngineError, match=pattern):
        select_profile(profiles, 5, 10)


# --- availability and lazy import -----------------------------------------------------------

def test_tensorrt_available_gives_a_one_line_reason():
    assert isinstance(TRT_OK, bool)
    if TRT_OK:
        assert TRT_REASON == ""
        return
    assert TRT_REASON and "\n" not in TRT_REASON
    if importlib.util.find_spec("tensorrt") is None:
        assert TRT_REASON.startswith(
            "tensorrt is not installed (pip install 'mbert-export[tensorrt]'")
        with pytest.raises(EngineError, match="tensorrt is not installed"):
            build_engine("model.onnx", "model.plan", profiles_from(1, 8))


def test_module_import_does_not_import_tensorrt():
    code = "import sys, mbert.export.tensorrt; print('tensorrt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- build_engine against a stand-in for the documented TensorRT Python API ------------------

def fake_tensorrt(version: str, *, parse_errors=(), build_error: str | None = None):
    """Just the calls build_engine makes, with the documented names and signatures."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.calls = calls = {}

    class ILogger:
        def __init__(self):
            pass

    class Logger(ILogger):
        ERROR, WARNING = 1, 2

        def __init__(self, min_severity=2):
            super().__init__()

    class Flag:  # enum members by name; 10.x value of STRONGLY_TYPED is 1, 11.x has no use for it
        STRONGLY_TYPED = 1 if version.startswith("10.") else 0

    class Tensor:
        def __init__(self, name):
            self.name, self.shape = name, (-1, -1)

    class Network:
        def __init__(self, flags):
            calls["network_flags"] = flags
            self.inputs = []
            self.num_inputs = 0

        def get_input(self, i):
            return self.inputs[i]

    class ParserError:
        def __init__(self, node, op, desc):
            self._node, self._op, self._desc = node, op, desc

        def node_name(self):
            return self._node

        def node_operator(self):
            return self._op

        def code(self):
            return "UNSUPPORTED_NODE"

        def desc(self):
            return self._desc

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, [ParserError(*e) for e in parse_errors]

        def parse_from_file(self, model):
            calls["parsed"] = model
            self.network.inputs = [Tensor("input_ids"), Tensor("attention_mask")]
            self.network.num_inputs = 2
            return not self.errors

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, index):
            return self.errors[index]

    class OptimizationProfile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, min, opt, max):  # noqa: A002 - TensorRT's keyword names
            self.shapes[name] = (tuple(min), tuple(opt), tuple(max))

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+timed"

    class Config:
        def __init__(self):
            self.builder_optimization_level = 3
            calls["profiles"], calls["cleared"] = [], []

        def set_memory_pool_limit(self, pool, size):
            calls["pool"] = (pool, size)

        def clear_flag(self, flag):
            calls["cleared"].append(flag)

        def add_optimization_profile(self, profile):
            calls["profiles"].append(profile.shapes)
            return len(calls["profiles"]) - 1

        def create_timing_cache(self, serialized_timing_cache):
            calls["cache_in"] = bytes(serialized_timing_cache)
            return TimingCache(serialized_timing_cache)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags=0):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return OptimizationProfile()

        def build_serialized_network(self, network, config):
            calls["opt_level"] = config.builder_optimization_level
            if build_error:
                self.logger.log(1, build_error)
                return None
            return b"PLAN"

    trt.ILogger, trt.Logger, trt.Builder, trt.OnnxParser = ILogger, Logger, Builder, OnnxParser
    trt.NetworkDefinitionCreationFlag = Flag
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.BuilderFlag = types.SimpleNamespace(TF32="TF32")
    return trt


@pytest.fixture
def onnx_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"onnx stand-in")
    return path


def install(monkeypatch, trt):
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(mtrt, "_gpu_info", lambda: ("NVIDIA H200", "9.0"))


@pytest.mark.parametrize("version, flags", [("10.13.3.9", 1 << 1), ("11.1.0.7", 0)])
def test_build_engine_calls(monkeypatch, tmp_path, onnx_file, version, flags):
    trt = fake_tensorrt(version)
    install(monkeypatch, trt)
    profiles = profiles_from(8, 64, split_seq=[16])
    cache = tmp_path / "timing.cache"
    info = build_engine(onnx_file, tmp_path / "out" / "model.plan", profiles, workspace_gib=0.5,
                        timing_cache_path=cache, builder_optimization_level=5)
    assert trt.calls["network_flags"] == flags  # STRONGLY_TYPED on 10.x only
    assert trt.calls["parsed"] == str(onnx_file)
    assert trt.calls["pool"] == ("WORKSPACE", 1 << 29)
    assert trt.calls["cleared"] == ["TF32"] and trt.calls["opt_level"] == 5
    assert trt.calls["profiles"] == [
        {name: (p.min, p.opt, p.max) for name in ("input_ids", "attention_mask")}
        for p in profiles]
    assert (tmp_path / "out" / "model.plan").read_bytes() == b"PLAN"
    assert trt.calls["cache_in"] == b"" and cache.read_bytes() == b"+timed"
    assert (info.tensorrt_version, info.gpu_name, info.compute_capability) == (version, "NVIDIA H200", "9.0")
    assert info.profiles == tuple(profiles) and info.workspace_gib == 0.5 and info.builder_optimization_level == 5
    assert (info.onnx, info.file, info.validation) == ("model.onnx", "model.plan", None)
    build_engine(onnx_file, tmp_path / "out" / "model.plan", profiles, timing_cache_path=cache)
    assert trt.calls["cache_in"] == b"+timed"  # the saved cache is loaded by the next build
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.plan"]


def test_build_engine_collects_every_parser_error(monkeypatch, tmp_path, onnx_file):
    install(monkeypatch, fake_tensorrt("10.13.0", parse_errors=[
        ("/layers.0/attn/Attention", "Attention", "unsupported attribute"),
        ("/head/Erf", "Erf", "no implementation for INT64")]))
    with pytest.raises(EngineError) as info:
        build_engine(onnx_file, tmp_path / "model.plan", profiles_from(1, 8))
    message = str(info.value)
    assert "(2 error(s))" in message and "\n" not in message
    assert "[/layers.0/attn/Attention Attention] UNSUPPORTED_NODE: unsupported attribute" in message
    assert "[/head/Erf Erf] UNSUPPORTED_NODE: no implementation for INT64" in message
    assert not (tmp_path / "model.plan").exists()


def test_failed_build_reports_log_and_keeps_old_plan(monkeypatch, tmp_path, onnx_file):
    install(monkeypatch, fake_tensorrt("10.13.0", build_error="Error Code 2: out of memory"))
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"previous")
    with pytest.raises(EngineError, match="out of memory"):
        build_engine(onnx_file, plan, profiles_from(1, 8))
    assert plan.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".model.plan.*"))


def test_build_engine_argument_errors(monkeypatch, tmp_path, onnx_file):
    install(monkeypatch, fake_tensorrt("10.13.0"))
    with pytest.raises(EngineError, match="at least one"):
        build_engine(onnx_file, tmp_path / "p", [])
    with pytest.raises(EngineError, match="not found"):
        build_engine(tmp_path / "missing.onnx", tmp_path / "p", profiles_from(1, 8))
    with pytest.raises(EngineError, match="log_level"):
        build_engine(onnx_file, tmp_path / "p", profiles_from(1, 8), log_level="loud")
    install(monkeypatch, fake_tensorrt("8.6.1"))
    with pytest.raises(EngineError, match="too old"):
        build_engine(onnx_file, tmp_path / "p", profiles_from(1, 8))


# --- real engines (TensorRT + CUDA GPU only) -------------------------------------------------

needs_trt = pytest.mark.skipif(not TRT_OK, reason=TRT_REASON or "TensorRT available")


def tiny_onnx(path: Path) -> None:
    """Embedding lookup masked by attention_mask, plus its mean over the sequence."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((64, HIDDEN)).astype(np.float32)
    ids = ["batch", "sequence"]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
         helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_3d"]),
         helper.make_node("Mul", ["emb", "mask_3d"], ["last_hidden_state"]),
         helper.make_node("ReduceMean", ["last_hidden_state"], ["sentence_embedding"],
                          axes=[1], keepdims=0)],
        "tiny",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ids)
         for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ids + [HIDDEN]),
         helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT,
                                       ["batch", HIDDEN])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@needs_trt
def test_real_engine_matches_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device for the runner's buffers")
    tiny_onnx(tmp_path / "model.onnx")
    profiles = profiles_from(4, 64, split_seq=[16])
    info = build_engine(tmp_path / "model.onnx", tmp_path / "model.plan", profiles,
                        workspace_gib=0.25, timing_cache_path=tmp_path / "timing.cache")
    assert info.compute_capability.count(".") == 1
    assert (tmp_path / "timing.cache").stat().st_size > 0
    runner = TensorRTRunner(tmp_path / "model.plan")
    assert runner.profiles == profiles
    session = ort.InferenceSession(str(tmp_path / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in ((2, 10), (3, 40), (1, 16), (4, 17), (2, 10)):  # switches profiles
        ids = rng.integers(0, 64, (batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[0, seq // 2:] = 0
        got = runner.run(input_ids=ids, attention_mask=mask)
        want = session.run(None, {"input_ids": ids, "attention_mask": mask})
        np.testing.assert_allclose(got["last_hidden_state"], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["sentence_embedding"], want[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineError, match=r"no optimization profile covers .*batch=5"):
        runner.run(input_ids=np.zeros((5, 8), np.int64), attention_mask=np.ones((5, 8), np.int64))


@needs_trt
def test_real_parser_error_is_engine_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not an onnx protobuf")
    with pytest.raises(EngineError, match="ONNX parser rejected"):
        build_engine(bad, tmp_path / "model.plan", profiles_from(1, 8))
