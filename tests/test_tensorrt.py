"""TensorRT, the parts that need no builder: optimization profiles, family detection and version
gates, the engine record (typed: its JSON round trip through the manifest schema and its checks),
the compatibility rules of both families as functions of the record and the machine, and the
engine options of the export. Real builds: ``test_tensorrt_build.py``; the precision walk:
``test_tensorrt_precision.py``; a real bundle with an engine: ``test_tensorrt_bundle.py``."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from trt_helpers import datacenter_record, rtx_record

from mbert.bundle.engine import (
    STATUS_NOT_RUN,
    STATUS_VALIDATED,
    BuilderOptions,
    EngineRecord,
    EngineValidation,
    Gpu,
    Profile,
    parse_capability,
)
from mbert.bundle.errors import BundleError, EngineError, OptionError
from mbert.bundle.schema import from_json, to_json
from mbert.bundle.validation import ValidationReport
from mbert.export.options import ExportOptions
from mbert.export.tensorrt.build import profiles_from
from mbert.runtime.backends.checks import can_run, engine_compatibility
from mbert.runtime.backends.family import (
    PORTABLE_CAPABILITIES,
    builder_available,
    resolve_family,
    runtime_version,
    version_problem,
)
from mbert.runtime.backends.tensorrt import select_profile

DATACENTER_INSTALLED = importlib.util.find_spec("tensorrt") is not None
RTX_3090 = Gpu("NVIDIA GeForce RTX 3090", "8.6")


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
    with pytest.raises(EngineError, match=r"no TensorRT builder can run here: TensorRT: tensorrt is not installed"):
        resolve_family("tensorrt")
    with pytest.raises(EngineError, match="--engine must be one of auto, tensorrt, tensorrt-rtx or none"):
        resolve_family("trt")


def test_importing_the_modules_does_not_import_tensorrt():
    code = ("import sys, mbert.export.tensorrt.stage, mbert.export.tensorrt.engine_only, mbert.export.tensorrt.build, mbert.export.tensorrt.precision, "
            "mbert.runtime.backends.checks, mbert.runtime.backends.tensorrt, mbert.runtime.backends, mbert.runtime.backends.verdicts; "
            "print(sorted(m for m in ('tensorrt', 'tensorrt_rtx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("text, want", [("8.6", (8, 6)), ("12.0", (12, 0)), (" 7.5", (7, 5))])
def test_parse_capability(text, want):
    assert parse_capability(text) == want


@pytest.mark.parametrize("text", ["86", "8.6.1", "sm_86", "", "8.x"])
def test_parse_capability_rejects(text):
    with pytest.raises(ValueError, match="not a compute capability"):
        parse_capability(text)


# --- the engine record ----------------------------------------------------------------------------

def roundtrip(record: EngineRecord) -> EngineRecord:
    return from_json(EngineRecord, json.loads(json.dumps(to_json(record), allow_nan=False)), "engine")


def test_record_round_trips_through_the_manifest_schema():
    validated = rtx_record(validation=EngineValidation(RTX_3090, "1.7.1.116", ValidationReport("model.plan", ("c",), ())),
                           not_run_reason=None)
    for record in (rtx_record(), datacenter_record(), validated):
        assert roundtrip(record) == record
    d = to_json(rtx_record())
    assert d["targets"] == ["8.6"] and d["built_on"] is None and d["validation"] is None
    assert d["profiles"][1] == {"min": [1, 129], "opt": [4, 512], "max": [8, 512]}
    assert d["precision_walk"]["file"] == "tensorrt_precision.json"


def test_status_and_summary():
    record = rtx_record()
    assert record.status == STATUS_NOT_RUN
    assert record.summary() == ("model.plan: TensorRT-RTX 1.7.1.116, 2 profile(s), runs on GPUs of compute capability "
                                "8.6 with TensorRT-RTX 1.7.1.116; built, not yet run (built on a machine without a "
                                "CUDA GPU)")
    ok = rtx_record(validation=EngineValidation(RTX_3090, "1.7.1.116", ValidationReport("model.plan", (), ())),
                    not_run_reason=None)
    assert ok.status == STATUS_VALIDATED and ok.summary().endswith(f"validated on {RTX_3090}")
    assert "any Ampere or newer" in datacenter_record(options=BuilderOptions(80.0, 3, False, True, True, False)).runs_on()
    assert "9.0 (NVIDIA H100 80GB HBM3)" in datacenter_record().runs_on()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("family"), r"^engine\.family: required key is missing"),
    (lambda d: d.update(family="trt"), r"^engine\.family: 'trt' is not one of 'tensorrt', 'tensorrt-rtx'"),
    (lambda d: d.update(version=10), r"^engine\.version: expected a string"),
    (lambda d: d.update(file="../model.plan"), r"^engine\.file: path '../model.plan' leads out of its folder"),
    (lambda d: d.update(profiles=[]), "profiles must not be empty"),
    (lambda d: d["profiles"][0].update(min=[0, 1]), r"^engine\.profiles\[0\]: profile batch sizes"),
    (lambda d: d.update(targets=["86"]), "targets: not a compute capability: '86'"),
    (lambda d: d.update(targets=[]), "must list its target compute capabilities"),
    (lambda d: d.update(built_on={"name": "x"}), r"^engine\.built_on\.compute_capability: required key is missing"),
    (lambda d: d["options"].update(workspace_gib=-1), "workspace_gib must be a positive number"),
    (lambda d: d["options"].update(timing_cache=True), "hardware_compatible and timing_cache are datacenter"),
    (lambda d: d["options"].pop("tf32"), r"^engine\.options\.tf32: required key is missing"),
    (lambda d: d.update(not_run_reason=None), "exactly one of validation and not_run_reason must be set"),
    (lambda d: d["precision_walk"].update(problems=["layers.0.mlp: the plan keeps it FP32 but ..."]),
     "the precision walk must be a passed walk"),  # a failed walk fails the export: never in a bundle
    (lambda d: d["precision_walk"]["sites"][0].update(tensorrt="half"), "precision must be one of float16"),
    (lambda d: d["precision_walk"].update(onnx="model.onnx"), "the precision walk must be a passed walk of model.fp16"),
    (lambda d: d.update(sha256="ab" * 32), r"^engine\.sha256: unknown key"),
])
def test_a_bad_record_is_refused_naming_the_key(edit, message):
    d = to_json(rtx_record())
    edit(d)
    with pytest.raises(BundleError, match=message):
        from_json(EngineRecord, d, "engine")


def test_datacenter_record_rules():
    d = to_json(datacenter_record())
    assert from_json(EngineRecord, d, "engine") == datacenter_record()
    with pytest.raises(BundleError, match="must record the GPU it was built on"):
        from_json(EngineRecord, dict(d, built_on=None), "engine")
    with pytest.raises(BundleError, match="targets are for TensorRT-RTX"):
        from_json(EngineRecord, dict(d, targets=["9.0"]), "engine")


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
    anywhere = datacenter_record(options=BuilderOptions(80.0, 3, False, True, True, False))
    for cc in ("8.0", "8.6", "9.0", "12.0"):
        assert engine_compatibility(anywhere, family_version="10.13.3.9", compute_capability=cc) == []
    (old,) = engine_compatibility(anywhere, family_version="10.13.3.9", compute_capability="7.5")
    assert "needs Ampere or newer (8.0+)" in old


def test_can_run_reads_the_installed_version():
    import tensorrt_rtx

    record = rtx_record(version=tensorrt_rtx.__version__, targets=("8.6", "8.9"))
    assert can_run(record, Gpu("NVIDIA GeForce RTX 4090", "8.9")) == (True, [])  # rules only: no plan given
    ok, problems = can_run(record, Gpu("NVIDIA H200", "9.0"))
    assert not ok and problems == ["GPU compute capability 9.0 is not among the plan's targets (8.6, 8.9)"]
    assert can_run(record, None) == (False, ["no CUDA GPU"])
    if not DATACENTER_INSTALLED:
        ok, problems = can_run(datacenter_record(), Gpu("NVIDIA H100 80GB HBM3", "9.0"))
        assert not ok and problems[0].startswith("TensorRT unavailable: tensorrt is not installed")


# --- the export's engine options, checked before any work ----------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(engine="trt"), "--engine must be one of auto, tensorrt, tensorrt-rtx or none, got 'trt'"),
    (dict(compute_capabilities=("9.0",)), "--compute-capability 9.0: TensorRT-RTX targets 7.5, 8.0, 8.6, 8.9, 12.0, "
                                          "12.1; 9.0 and 10.0 GPUs (H100, H200, B200) need datacenter TensorRT"),
    (dict(compute_capabilities=("sm86",)), "--compute-capability sm86"),
    (dict(compute_capabilities=()), "--compute-capability needs at least one capability"),
    (dict(engine="tensorrt", compute_capabilities=("8.6",)), "does not apply with --engine tensorrt"),
    (dict(engine="tensorrt-rtx", hardware_compatible=True), "--hardware-compatible is a datacenter TensorRT option"),
    (dict(engine="none", compute_capabilities=("8.6",)), "does not apply with --engine none"),
    (dict(compute_capabilities=("8.6",), hardware_compatible=True), "exclude each other"),
    (dict(fp16=False, engine="tensorrt-rtx"), "they apply only with --fp16"),
    (dict(workspace_gib=0.0), "--workspace-gib must be a positive number"),
    (dict(engine="tensorrt-rtx", triton_encoder="trt"), "needs --fp16 and a datacenter TensorRT engine (Triton cannot "
                                                        "load TensorRT-RTX plans)"),
])
def test_engine_options_are_checked(kwargs, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ExportOptions(**{"fp16": True, **kwargs}).check()


def test_engine_options_choose_the_family():
    assert ExportOptions(fp16=True).family == "auto" and ExportOptions(fp16=True).workspace_gib is None
    assert ExportOptions(fp16=True, compute_capabilities=("8.6",)).family == "tensorrt-rtx"
    assert ExportOptions(fp16=True, hardware_compatible=True).family == "tensorrt"
    assert ExportOptions(fp16=True, engine="tensorrt-rtx").family == "tensorrt-rtx"
    ExportOptions(fp16=True, engine="tensorrt-rtx", compute_capabilities=("7.5", "12.1")).check()
    ExportOptions(fp16=False, engine="none").check()
