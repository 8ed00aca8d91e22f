"""Real TensorRT-RTX builds (no GPU needed): the small overflow checkpoint's FP16 graph parsed and built
with two optimization profiles and two target compute capabilities, the record it returns, the
builder log, failures (the naive FP16 graph, a broken file) and the options each family refuses.

Datacenter TensorRT cannot be installed here and its builder needs a GPU: its one datacenter-only
call shape (the STRONGLY_TYPED flag on 10.x) is checked on a two-attribute stand-in, named below.
Running a plan needs a GPU: ``test_rtx_engine_runs_and_matches_onnxruntime`` does it where one
that TensorRT-RTX supports is present and is skipped elsewhere."""
from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest
import tensorrt_rtx

from mbert.export.trt_build import (
    _configure, _targets, build_engine, network_flags, parse_onnx, tensorrt_verdict,
)
from mbert.modeling.errors import EngineError
from mbert.runtime.trt_compat import PORTABLE_CAPABILITIES, can_run, rtx_plan_validity
from mbert.runtime.trt_family import current_gpu
from mbert.runtime.trt_profiles import profiles_from
from mbert.runtime.trt_record import STATUS_NOT_RUN, BuilderOptions, EngineRecord
from trt_graphs import overflow_graphs

GPU = current_gpu()
PROFILES = profiles_from(4, 256, split_seq=[128])  # two profiles: 1..128 and 129..256 tokens


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    return overflow_graphs(tmp_path_factory)


@pytest.fixture(scope="module")
def built(graphs, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtx-build")
    record = build_engine(graphs.fp16, out / "model.plan", PROFILES, family="tensorrt-rtx",
                          compute_capabilities=["8.6", "12.0"], workspace_gib=1.0,
                          log_path=out / "tensorrt_build.log")
    return record, out


def test_fp16_graph_builds_with_two_profiles_and_two_targets(built):
    record, out = built
    plan = (out / "model.plan").read_bytes()
    assert record.family == "tensorrt-rtx" and record.version == tensorrt_rtx.__version__
    assert record.targets == ("8.6", "12.0") and record.built_on == GPU
    assert list(record.profiles) == PROFILES and len(record.profiles) == 2
    assert record.plan == "model.plan" and record.onnx == "model.fp16.onnx"
    assert record.plan_bytes == len(plan) and record.plan_sha256 == hashlib.sha256(plan).hexdigest()
    assert record.options == BuilderOptions(workspace_gib=1.0)  # strongly typed, TF32 off, no datacenter options
    assert record.status == STATUS_NOT_RUN and record.build_seconds > 0
    assert EngineRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    if GPU is None:
        assert record.not_run_reason == "built on a machine without a CUDA GPU"
    assert sorted(p.name for p in out.iterdir()) == ["model.plan", "tensorrt_build.log"]


def test_build_log_keeps_engine_layer_information_and_attention_fusion(built):
    record, out = built
    log = (out / "tensorrt_build.log").read_text()
    assert log.startswith(f"# TensorRT-RTX {tensorrt_rtx.__version__} build of model.fp16.onnx -> model.plan")
    assert "Engine Layer Information" in log and "Layer(Myelin)" in log
    assert "Found and reassigned Myelin backends for Self-Attention nodes" in log
    assert "[W] " in log and record.build_log == "tensorrt_build.log"


def test_plan_is_judged_by_its_targets_and_tensorrt_rtx(built):
    record, out = built
    assert can_run(record, None) == (False, ["no CUDA GPU"])
    if GPU is None:  # TensorRT-RTX's own header check answers INVALID without a GPU (documented)
        (problem,) = rtx_plan_validity(out / "model.plan")
        assert problem.startswith("TensorRT-RTX's validity check says INVALID")


@pytest.mark.skipif(GPU is not None, reason="checks what happens without a GPU")
def test_without_a_gpu_the_plan_cannot_be_loaded_and_says_why(built):
    from mbert.runtime.trt_runner import TensorRTRunner, load_engine

    _, out = built
    with pytest.raises(EngineError, match=r"TensorRT-RTX .* cannot load .*model.plan .*deserializeCudaEngine"):
        load_engine(out / "model.plan", family="tensorrt-rtx")  # the real runtime, asked without a GPU
    with pytest.raises(EngineError, match="TensorRTRunner needs a CUDA build of torch and a visible GPU"):
        TensorRTRunner(out / "model.plan", family="tensorrt-rtx")
    with pytest.raises(EngineError, match="engine plan not found"):
        load_engine(out / "missing.plan", family="tensorrt-rtx")


def test_targets_default_to_the_portable_set_and_are_checked():
    assert _targets(tensorrt_rtx, "tensorrt-rtx", None) == PORTABLE_CAPABILITIES == ("8.0", "8.6", "8.9", "12.0")
    assert _targets(tensorrt_rtx, "tensorrt-rtx", ["8.9", "12.0", "8.9"]) == ("8.9", "12.0")
    with pytest.raises(EngineError, match=r"cannot target compute capability 9.0; it supports 7.5, 8.0, 8.6, 8.9, "
                                          r"12.0, 12.1 \(9.0 and 10.0 GPUs need datacenter TensorRT\)"):
        _targets(tensorrt_rtx, "tensorrt-rtx", ["8.6", "9.0"])
    with pytest.raises(EngineError, match="not a compute capability: 'sm86'"):
        _targets(tensorrt_rtx, "tensorrt-rtx", ["sm86"])
    with pytest.raises(EngineError, match="compute capabilities are targets of TensorRT-RTX"):
        _targets(tensorrt_rtx, "tensorrt", ["8.6"])


def test_builder_config_carries_the_options(graphs):
    parsed = parse_onnx(graphs.fp16, "tensorrt-rtx")
    config = _configure(parsed, PROFILES, ("8.6", "8.9"), BuilderOptions(workspace_gib=0.5, optimization_level=2),
                        None)
    assert config.num_optimization_profiles == 2 and config.builder_optimization_level == 2
    assert not config.get_flag(tensorrt_rtx.BuilderFlag.TF32)
    assert config.get_memory_pool_limit(tensorrt_rtx.MemoryPoolType.WORKSPACE) == 1 << 29
    assert config.num_compute_capabilities == 2
    assert [config.get_compute_capability(i) for i in range(2)] == [tensorrt_rtx.ComputeCapability.SM86,
                                                                    tensorrt_rtx.ComputeCapability.SM89]
    assert parsed.network.num_inputs == 2 and parsed.network.get_input(0).name == "input_ids"


def test_strongly_typed_flag_only_on_datacenter_10x():
    assert network_flags(tensorrt_rtx, "tensorrt-rtx") == 0  # TensorRT-RTX is always strongly typed
    # Stand-in for datacenter TensorRT's enum (not installable here): STRONGLY_TYPED is 1 in 10.x.
    for version, want in (("10.13.3.9", 1 << 1), ("11.1.0.7", 0)):
        stand_in = types.SimpleNamespace(__version__=version,
                                         NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=1))
        assert network_flags(stand_in, "tensorrt") == want


def test_tensorrt_rtx_refuses_datacenter_options(graphs, tmp_path):
    for kwargs in (dict(timing_cache_path=tmp_path / "cache"), dict(hardware_compatible=True)):
        with pytest.raises(EngineError, match="TensorRT-RTX has no timing cache and no hardware-compatibility level"):
            build_engine(graphs.fp16, tmp_path / "model.plan", PROFILES, family="tensorrt-rtx", **kwargs)
    with pytest.raises(EngineError, match="at least one optimization profile"):
        build_engine(graphs.fp16, tmp_path / "model.plan", [], family="tensorrt-rtx")
    assert not list(tmp_path.iterdir())


def test_naive_fp16_graph_fails_to_build_and_keeps_the_old_plan(graphs, tmp_path):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"previous plan")
    with pytest.raises(EngineError, match=r"TensorRT-RTX could not build an engine from .*naive.fp16.onnx \(workspace limit 4 GiB.*\): .*Myelin"):
        build_engine(graphs.naive, plan, PROFILES, family="tensorrt-rtx")
    assert plan.read_bytes() == b"previous plan" and [p.name for p in tmp_path.iterdir()] == ["model.plan"]


def test_tensorrt_verdicts_beside_onnx_runtime(graphs):
    naive = tensorrt_verdict(graphs.naive, PROFILES, family="tensorrt-rtx")
    assert naive["parsed"] and not naive["built"]
    (error,) = naive["errors"]  # TensorRT's own text, verbatim (multi-line)
    assert "Error during shape inference" in error and "element type (float) differs from input 1's element type (half)" \
        in error
    ours = tensorrt_verdict(graphs.fp16, PROFILES[:1], family="tensorrt-rtx")
    assert ours["built"] and ours["errors"] == [] and ours["plan_bytes"] > 0
    json.dumps(naive), json.dumps(ours)


def test_parser_errors_are_engine_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not an onnx protobuf")
    with pytest.raises(EngineError, match=r"TensorRT-RTX.s ONNX parser rejected .*bad.onnx: it holds no graph outputs"):
        build_engine(bad, tmp_path / "model.plan", PROFILES, family="tensorrt-rtx")
    verdict = tensorrt_verdict(bad, PROFILES, family="tensorrt-rtx")
    assert not verdict["parsed"] and "ONNX parser rejected" in verdict["errors"][0]
    with pytest.raises(EngineError, match="ONNX file not found"):
        parse_onnx(tmp_path / "missing.onnx", "tensorrt-rtx")


@pytest.mark.skipif(GPU is None or GPU.compute_capability not in ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1"),
                    reason=f"needs a GPU TensorRT-RTX supports (here: {GPU or 'no GPU'})")
def test_rtx_engine_runs_and_matches_onnxruntime(graphs, tmp_path):  # pragma: no cover - needs a GPU
    import onnxruntime as ort

    from mbert.runtime.trt_runner import TensorRTRunner

    record = build_engine(graphs.fp16, tmp_path / "model.plan", PROFILES, family="tensorrt-rtx",
                          compute_capabilities=[GPU.compute_capability])
    assert can_run(record, GPU, tmp_path / "model.plan") == (True, [])
    runner = TensorRTRunner(tmp_path / "model.plan", family="tensorrt-rtx")
    assert runner.profiles == PROFILES
    session = ort.InferenceSession(str(graphs.fp32), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in ((2, 10), (3, 200), (1, 128), (4, 129)):  # switches profiles
        ids = rng.integers(5, 50000, (batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[0, seq // 2:] = 0
        got = runner.run(input_ids=ids, attention_mask=mask)["last_hidden_state"]
        want = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})[0]
        keep = mask.astype(bool)
        cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert np.isfinite(got).all() and cos[keep].min() >= 0.999  # FP16 per-token tolerance (fp16.py)
