"""Real TensorRT-RTX builds (no GPU needed): the small overflow checkpoint's FP16 graph parsed and built
with two optimization profiles and two target compute capabilities, what the build returns, the
builder log, failures (the naive FP16 graph, a broken file) and the options each family refuses.

Datacenter TensorRT cannot be installed here and its builder needs a GPU: its one datacenter-only
call shape (the STRONGLY_TYPED flag on 10.x) is checked on a two-attribute stand-in, named below.
Running a plan needs a GPU: ``test_rtx_engine_runs_and_matches_onnxruntime`` does it where one
that TensorRT-RTX supports is present and is skipped elsewhere."""
from __future__ import annotations

import types

import numpy as np
import pytest
import tensorrt_rtx
from trt_helpers import overflow_graphs, rtx_record

from mbert.bundle.engine import BuilderOptions, TensorRTVerdict
from mbert.bundle.errors import EngineError
from mbert.export.tensorrt.build import (
    _configure,
    _targets,
    build_engine,
    build_log_text,
    network_flags,
    parse_onnx,
    profiles_from,
    tensorrt_verdict,
)
from mbert.runtime.backends.checks import can_run
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.family import PORTABLE_CAPABILITIES
from mbert.runtime.backends.checks import rtx_plan_validity

GPU = current_gpu()
PROFILES = profiles_from(4, 256, split_seq=[128])  # two profiles: 1..128 and 129..256 tokens


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    return overflow_graphs(tmp_path_factory)


@pytest.fixture(scope="module")
def built(graphs, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtx-build")
    return build_engine(graphs.fp16, out / "model.plan", PROFILES, family="tensorrt-rtx",
                        compute_capabilities=["8.6", "12.0"], workspace_gib=1.0), out


def test_fp16_graph_builds_with_two_profiles_and_two_targets(built):
    plan, out = built
    assert plan.family == "tensorrt-rtx" and plan.version == tensorrt_rtx.__version__
    assert plan.targets == ("8.6", "12.0") and plan.built_on == GPU
    assert list(plan.profiles) == PROFILES and len(plan.profiles) == 2
    assert plan.plan == out / "model.plan" and plan.onnx.name == "model.fp16.onnx"
    assert (out / "model.plan").stat().st_size > 100_000  # weights included (3 layers x hidden 128 in FP16/FP32)
    # strongly typed, TF32 off, the workspace limit asked for, no datacenter options
    assert plan.options == BuilderOptions(1.0, 3, False, True, False, False)
    assert plan.seconds > 0 and plan.runs_on() == "GPUs of compute capability 8.6, 12.0"
    assert sorted(p.name for p in out.iterdir()) == ["model.plan"]


def test_without_a_workspace_limit_tensorrt_keeps_its_own(graphs, tmp_path):
    parsed = parse_onnx(graphs.fp16, "tensorrt-rtx")
    default = parsed.builder.create_builder_config().get_memory_pool_limit(tensorrt_rtx.MemoryPoolType.WORKSPACE)
    config = _configure(parsed, PROFILES[:1], ("8.6",), workspace_gib=None, optimization_level=3,
                        hardware_compatible=False, cache_bytes=None)
    assert config.get_memory_pool_limit(tensorrt_rtx.MemoryPoolType.WORKSPACE) == default > 1 << 30


def test_build_log_keeps_engine_layer_information_and_attention_fusion(built):
    plan, _ = built
    log = build_log_text(plan)
    assert log.startswith(f"# TensorRT-RTX {tensorrt_rtx.__version__} build of model.fp16.onnx -> model.plan")
    assert "# runs on: GPUs of compute capability 8.6, 12.0" in log
    assert "Engine Layer Information" in log and "Layer(Myelin)" in log
    assert "Found and reassigned Myelin backends for Self-Attention nodes" in log
    assert "[W] " in log and "[V] " in log


def test_plan_is_judged_by_its_targets_and_tensorrt_rtx(built):
    plan, out = built
    record = rtx_record(version=plan.version, targets=plan.targets)
    assert can_run(record, None) == (False, ["no CUDA GPU"])
    if GPU is None:  # TensorRT-RTX's own header check answers INVALID without a GPU (documented)
        (problem,) = rtx_plan_validity(out / "model.plan")
        assert problem.startswith("TensorRT-RTX's validity check says INVALID")


@pytest.mark.skipif(GPU is not None, reason="checks what happens without a GPU")
def test_without_a_gpu_the_plan_cannot_be_loaded_and_says_why(built):
    from mbert.runtime.backends.tensorrt import TensorRTRunner, load_engine

    _, out = built
    with pytest.raises(EngineError, match=r"TensorRT-RTX .* cannot load .*model.plan .*deserializeCudaEngine"):
        load_engine(out / "model.plan", family="tensorrt-rtx")  # the real runtime, asked without a GPU
    with pytest.raises(EngineError, match="TensorRTRunner needs a visible CUDA GPU and its driver"):
        TensorRTRunner(out / "model.plan", family="tensorrt-rtx")
    with pytest.raises(EngineError, match=r"missing.plan \(engine plan\): file not found"):
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
    config = _configure(parsed, PROFILES, ("8.6", "8.9"), workspace_gib=0.5, optimization_level=2,
                        hardware_compatible=False, cache_bytes=None)
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
    with pytest.raises(EngineError, match=r"TensorRT-RTX could not build an engine from .*naive.fp16.onnx \(workspace limit "
                                          r"4 GiB.*\): .*Myelin"):
        build_engine(graphs.naive, plan, PROFILES, family="tensorrt-rtx", workspace_gib=4.0)
    assert plan.read_bytes() == b"previous plan" and [p.name for p in tmp_path.iterdir()] == ["model.plan"]


def test_tensorrt_verdicts_beside_onnx_runtime(graphs):
    naive = tensorrt_verdict(graphs.naive, PROFILES, family="tensorrt-rtx")
    assert naive.parsed and not naive.built and naive.family == "tensorrt-rtx"
    # TensorRT's own text, on one line: the naive graph's RoPE arange mixes float and half
    assert naive.error.startswith("IBuilder::buildSerializedNetwork: Error Code 1: Myelin")
    assert "Error during shape inference" in naive.error
    assert "element type (float) differs from input 1's element type (half)" in naive.error
    assert "\n" not in naive.error and naive.describe().startswith("TensorRT-RTX 1.7.1.116: does not build: IBuilder")
    ours = tensorrt_verdict(graphs.fp16, PROFILES[:1], family="tensorrt-rtx")
    assert ours == TensorRTVerdict("tensorrt-rtx", tensorrt_rtx.__version__, True, True, None)


def test_parser_errors_are_engine_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not an onnx protobuf")
    with pytest.raises(EngineError, match=r"TensorRT-RTX.s ONNX parser rejected .*bad.onnx: it holds no graph outputs"):
        build_engine(bad, tmp_path / "model.plan", PROFILES, family="tensorrt-rtx")
    verdict = tensorrt_verdict(bad, PROFILES, family="tensorrt-rtx")
    assert not verdict.parsed and not verdict.built and "ONNX parser rejected" in verdict.error
    with pytest.raises(EngineError, match="ONNX file not found"):
        parse_onnx(tmp_path / "missing.onnx", "tensorrt-rtx")


@pytest.mark.skipif(GPU is None or GPU.compute_capability not in ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1"),
                    reason=f"needs a GPU TensorRT-RTX supports (here: {GPU or 'no GPU'})")
def test_rtx_engine_runs_and_matches_onnxruntime(graphs, tmp_path):  # pragma: no cover - needs a GPU
    import onnxruntime as ort

    from mbert.runtime.backends.tensorrt import TensorRTRunner

    plan = build_engine(graphs.fp16, tmp_path / "model.plan", PROFILES, family="tensorrt-rtx",
                        compute_capabilities=[GPU.compute_capability])
    record = rtx_record(version=plan.version, targets=plan.targets)
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
