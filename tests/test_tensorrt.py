"""TensorRT, the parts that need no builder: optimization profiles, family detection and version
gates, the engine record (JSON round trip and validation) and the compatibility rules of both
families as functions of the record and the machine. Real builds: ``test_tensorrt_build.py``; the
precision walk: ``test_tensorrt_precision.py``."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from mbert.export.tensorrt import Profile, profiles_from, select_profile, tensorrt_available
from mbert.modeling.errors import BundleError, EngineError
from mbert.runtime.trt_compat import PORTABLE_CAPABILITIES, can_run, engine_compatibility
from mbert.runtime.trt_family import (
    Gpu, builder_available, parse_capability, resolve_family, runtime_version, version_problem,
)
from mbert.runtime.trt_record import (
    STATUS_FAILED, STATUS_NOT_RUN, STATUS_VALIDATED, BuilderOptions, EngineRecord, Validation,
)

DATACENTER_INSTALLED = importlib.util.find_spec("tensorrt") is not None
SHA = "ab" * 32


# --- Profile / profiles_from / select_profile ------------------------------------------------

def test_profile_accepts_valid_and_normalises_to_tuples():
    profile = Profile([1, 1], (4, np.int64(128)), (8, 512))
    assert profile.opt == (4, 128) and isinstance(profile.min, tuple)
    assert profile.covers(1, 1) and profile.covers(8, 512) and not profile.covers(9, 10)
    assert Profile.from_any(profile.as_lists()) == profile
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
def test_profile_validation_raises_engine_error(args):
    with pytest.raises(EngineError):
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


# --- families, version gates, availability -------------------------------------------------------

@pytest.mark.parametrize("family, version, problem", [
    ("tensorrt", "10.12.0.36", None), ("tensorrt", "10.16.1", None), ("tensorrt", "11.1.0.7", None),
    ("tensorrt", "10.11.0", "too old: 10.12"), ("tensorrt", "8.6.1", "too old"),
    ("tensorrt", "12.0.0", "newer than this project supports"), ("tensorrt-rtx", "1.7.1.116", None),
    ("tensorrt-rtx", "1.9.0", None), ("tensorrt-rtx", "1.6.0", "too old: 1.7"),
    ("tensorrt-rtx", "2.0.0", "newer than"), ("tensorrt-rtx", "dev", "unrecognised"),
])
def test_version_gates(family, version, problem):
    got = version_problem(family, version)
    assert got is None if problem is None else problem in got
    with pytest.raises(EngineError, match="unknown TensorRT family 'trt'"):
        version_problem("trt", "10.12")


def test_tensorrt_rtx_builder_is_available_without_a_gpu():
    import tensorrt_rtx

    found = builder_available("tensorrt-rtx")
    assert found.ok and found.version == tensorrt_rtx.__version__ == "1.7.1.116"
    assert str(found) == "TensorRT-RTX 1.7.1.116"


@pytest.mark.skipif(DATACENTER_INSTALLED, reason="datacenter TensorRT is installed here")
def test_auto_picks_the_installed_builder_and_says_which():
    missing = builder_available("tensorrt")
    assert not missing.ok and missing.reason.startswith("tensorrt is not installed (pip install 'mbert-export[tensorrt]'")
    assert runtime_version("tensorrt").reason == missing.reason and "\n" not in missing.reason
    assert resolve_family("auto").family == "tensorrt-rtx"
    assert tensorrt_available() == (False, missing.reason)  # the previous pipeline's gate: datacenter only
    with pytest.raises(EngineError, match=r"no TensorRT builder can run here: TensorRT: tensorrt is not installed"):
        resolve_family("tensorrt")
    with pytest.raises(EngineError, match="--engine must be one of auto, tensorrt, tensorrt-rtx"):
        resolve_family("trt")


def test_importing_the_modules_does_not_import_tensorrt():
    code = ("import sys, mbert.export.tensorrt, mbert.export.trt_build, mbert.runtime.trt_compat, "
            "mbert.runtime.trt_runner; print(sorted(m for m in ('tensorrt', 'tensorrt_rtx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("text, want", [("8.6", (8, 6)), ("12.0", (12, 0)), (" 7.5", (7, 5))])
def test_parse_capability(text, want):
    assert parse_capability(text) == want


@pytest.mark.parametrize("text", ["86", "8.6.1", "sm_86", "", "8.x"])
def test_parse_capability_rejects(text):
    with pytest.raises(EngineError, match="not a compute capability"):
        parse_capability(text)


# --- the engine record ------------------------------------------------------------------------------

def rtx_record(**changes) -> EngineRecord:
    base = EngineRecord(
        family="tensorrt-rtx", version="1.7.1.116", plan="model.plan", onnx="model.fp16.onnx", plan_sha256=SHA,
        plan_bytes=1234, profiles=tuple(profiles_from(8, 512, split_seq=[128])), targets=("8.6",), built_on=None,
        options=BuilderOptions(), build_seconds=3.5, not_run_reason="built on a machine without a CUDA GPU",
        build_log="tensorrt_build.log")
    return dataclasses.replace(base, **changes)


def datacenter_record(**changes) -> EngineRecord:
    base = EngineRecord(
        family="tensorrt", version="10.13.3.9", plan="model.plan", onnx="model.fp16.onnx", plan_sha256=SHA,
        plan_bytes=99, profiles=(Profile((1, 1), (4, 128), (8, 512)),), targets=(),
        built_on=Gpu("NVIDIA H100 80GB HBM3", "9.0"), options=BuilderOptions(timing_cache=True), build_seconds=20.0)
    return dataclasses.replace(base, **changes)


def test_record_round_trips_through_json():
    for record in (rtx_record(), datacenter_record(),
                   rtx_record(validations=(Validation(Gpu("NVIDIA GeForce RTX 3090", "8.6"), "1.7.1.116", True,
                                                      "parity grid: 24 cases passed"),))):
        text = json.dumps(record.to_dict())
        assert EngineRecord.from_dict(json.loads(text)) == record
    d = rtx_record().to_dict()
    assert d["status"] == STATUS_NOT_RUN and d["targets"] == ["8.6"] and d["built_on"] is None
    assert d["profiles"][1] == {"min": [1, 129], "opt": [4, 512], "max": [8, 512]}


def test_status_follows_validations():
    gpu = Gpu("NVIDIA GeForce RTX 3090", "8.6")
    record = rtx_record()
    assert record.status == STATUS_NOT_RUN and record.validated_on == ()
    assert "built, not yet run (built on a machine without a CUDA GPU)" in record.summary()
    ok = record.with_validation(Validation(gpu, "1.7.1.116", True, "passed"))
    assert ok.status == STATUS_VALIDATED and ok.validated_on == (gpu,) and "validated on NVIDIA GeForce RTX 3090" in ok.summary()
    assert ok.with_validation(Validation(gpu, "1.7.1.116", False, "cosine 0.93")).status == STATUS_FAILED
    assert "runs on GPUs of compute capability 8.6 with TensorRT-RTX 1.7.1.116" in record.summary()
    assert "any Ampere or newer" in datacenter_record(options=BuilderOptions(hardware_compatible=True)).runs_on()
    assert "9.0 (NVIDIA H100 80GB HBM3)" in datacenter_record().runs_on()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("family"), "engine record: family is missing"),
    (lambda d: d.update(family="trt"), "family must be one of tensorrt, tensorrt-rtx, got 'trt'"),
    (lambda d: d.update(version=10), "version must be str, got 10"),
    (lambda d: d.update(plan="../model.plan"), "plan must be a plain file name inside the bundle"),
    (lambda d: d.update(plan_sha256="xyz"), "plan_sha256 must be 64 lowercase hex digits"),
    (lambda d: d.update(plan_bytes=True), "plan_bytes must be int, got True"),
    (lambda d: d.update(profiles=[]), "profiles must be a non-empty tuple"),
    (lambda d: d["profiles"][0].update(min=[0, 1]), r"profiles\[0\] profile batch sizes"),
    (lambda d: d.update(targets=["86"]), "targets: not a compute capability: '86'"),
    (lambda d: d.update(targets=[]), "must list its target compute capabilities"),
    (lambda d: d.update(built_on={"name": "x"}), "built_on.compute_capability is missing"),
    (lambda d: d["options"].update(workspace_gib=-1), "options workspace_gib must be a positive number"),
    (lambda d: d["options"].update(timing_cache=True), "hardware_compatible and timing_cache are datacenter"),
    (lambda d: d["options"].pop("tf32"), "options.tf32 is missing"),
    (lambda d: d.update(status="validated"), "status is 'validated' but the validations say 'built, not yet run'"),
    (lambda d: d.update(validations=[{"gpu": {"name": "g", "compute_capability": "8.6"}, "version": "1",
                                      "passed": "yes", "summary": ""}]), r"validations\[0\].passed must be bool"),
    (lambda d: d.update(sha256=SHA), r"has unknown key\(s\) \['sha256'\]"),
])
def test_record_from_dict_names_the_bad_key(edit, message):
    d = rtx_record().to_dict()
    edit(d)
    with pytest.raises(BundleError, match=message):
        EngineRecord.from_dict(d)


def test_datacenter_record_rules():
    d = datacenter_record().to_dict()
    assert EngineRecord.from_dict(d) == datacenter_record()
    with pytest.raises(BundleError, match="must record the GPU it was built on"):
        EngineRecord.from_dict(dict(d, built_on=None))
    with pytest.raises(BundleError, match="targets are for TensorRT-RTX"):
        EngineRecord.from_dict(dict(d, targets=["9.0"]))
    with pytest.raises(EngineError, match="invalid engine record: family must be one of"):
        datacenter_record(family="onnxruntime")


# --- compatibility rules ----------------------------------------------------------------------------

def test_rtx_plan_for_8_6_is_refused_elsewhere_and_accepted_on_8_6():
    record = rtx_record(targets=("8.6",))
    assert engine_compatibility(record, family_version="1.7.1.116", compute_capability="8.6") == []
    (cc,) = engine_compatibility(record, family_version="1.7.1.116", compute_capability="8.9")
    assert cc == "GPU compute capability 8.9 is not among the plan's targets (8.6)"
    assert "not among" in engine_compatibility(record, family_version="1.7.1.116", compute_capability="9.0")[0]
    (ver,) = engine_compatibility(record, family_version="1.8.0.1", compute_capability="8.6")
    assert "TensorRT-RTX version: the plan was built with 1.7.1.116, this machine has 1.8.0.1" in ver
    assert engine_compatibility(record, family_version=None, compute_capability=None) == [
        "TensorRT-RTX is not installed (pip install 'mbert-export[tensorrt-rtx]')", "no CUDA GPU"]
    portable = rtx_record(targets=PORTABLE_CAPABILITIES)
    for cc in ("8.0", "8.6", "8.9", "12.0"):
        assert engine_compatibility(portable, family_version="1.7.1.116", compute_capability=cc) == []
    for cc in ("7.5", "9.0", "10.0", "12.1"):
        assert engine_compatibility(portable, family_version="1.7.1.116", compute_capability=cc)


def test_datacenter_plan_needs_same_version_and_capability_unless_hardware_compatible():
    record = datacenter_record()  # built on 9.0 with 10.13.3.9
    assert engine_compatibility(record, family_version="10.13.3.9", compute_capability="9.0") == []
    (cc,) = engine_compatibility(record, family_version="10.13.3.9", compute_capability="8.9")
    assert cc == "GPU compute capability: the plan was built for 9.0 (NVIDIA H100 80GB HBM3), this GPU is 8.9"
    (ver,) = engine_compatibility(record, family_version="10.14.1", compute_capability="9.0")
    assert "TensorRT version: the plan was built with 10.13.3.9, this machine has 10.14.1" in ver
    assert len(engine_compatibility(record, family_version="11.0", compute_capability="12.0")) == 2
    anywhere = datacenter_record(options=BuilderOptions(hardware_compatible=True))
    for cc in ("8.0", "8.6", "9.0", "12.0"):
        assert engine_compatibility(anywhere, family_version="10.13.3.9", compute_capability=cc) == []
    (old,) = engine_compatibility(anywhere, family_version="10.13.3.9", compute_capability="7.5")
    assert "needs Ampere or newer (8.0+)" in old


def test_can_run_reads_the_installed_version():
    import tensorrt_rtx

    record = rtx_record(version=tensorrt_rtx.__version__, targets=("8.6", "8.9"))
    assert can_run(record, Gpu("NVIDIA GeForce RTX 4090", "8.9")) == (True, [])
    ok, problems = can_run(record, Gpu("NVIDIA H200", "9.0"))
    assert not ok and problems == ["GPU compute capability 9.0 is not among the plan's targets (8.6, 8.9)"]
    assert can_run(record, None) == (False, ["no CUDA GPU"])
    if not DATACENTER_INSTALLED:
        ok, problems = can_run(datacenter_record(), Gpu("NVIDIA H100 80GB HBM3", "9.0"))
        assert not ok and problems[0].startswith("TensorRT unavailable: tensorrt is not installed")
