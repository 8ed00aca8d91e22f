"""A real bundle with a real TensorRT-RTX engine, exported once by the command line
(``mbert-export CKPT --fp16 --engine tensorrt-rtx --compute-capability 8.6,12.0``; layer 2 of the
checkpoint overflows FP16): its typed engine record, the precision walk it carries, ``mbert-run
info``, Triton, and the runtime's rules for it.

Running the plan needs a GPU (none here). The runtime's first run of a "built, not yet run" plan is
tested with ``StandInEngine``: a stand-in for deserializing and executing the plan only (it runs
ONNX graphs on ONNX Runtime CPU in its place); the parity grid, the verdict, its cache and the
refusal are the real code.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import tensorrt_rtx
from click.testing import CliRunner
from trt_helpers import RTX_EXPORT_TARGETS

from mbert.bundle import Profile, open_bundle
from mbert.bundle.engine import STATUS_NOT_RUN, STATUS_VALIDATED, EngineValidation, Gpu
from mbert.bundle.errors import BundleError, EngineError
from mbert.bundle.schema import from_json
from mbert.export.fp16.naive import write_naive_fp16
from mbert.export.fp16.precision import load_precision
from mbert.runtime.backends import backend_statuses, open_backend
from mbert.runtime.backends.checks import check_engine, engine_compatibility
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.verdicts import EngineVerdict, first_open_check

GPU = current_gpu()
RTX_3090 = Gpu("NVIDIA GeForce RTX 3090", "8.6")
RTX_5090 = Gpu("NVIDIA GeForce RTX 5090", "12.0")
FP32_SITES = {"layers.2.residual", "layers.2.mlp", "final_norm"}  # layer 2's MLP output overflows FP16


def plan_status(separator: str) -> str:
    """What the export (``" ("``) and ``mbert-run info`` (``": "``) say of the plan on this machine: with
    no GPU "built, not yet run" and why; on a GPU outside the plan's targets, the same naming that GPU;
    on a target GPU, validated on it."""
    if GPU is None:
        return f"{STATUS_NOT_RUN}{separator}built on a machine without a CUDA GPU"
    if GPU.compute_capability not in RTX_EXPORT_TARGETS:
        return f"{STATUS_NOT_RUN}{separator}this machine's {GPU} cannot run it"
    return f"{STATUS_VALIDATED} on {GPU}"


@pytest.fixture(scope="module")
def exported(rtx_export):
    proc, _checkpoint, folder = rtx_export
    return proc, folder


class StandInEngine:
    """Stand-in for deserializing and executing the plan (a GPU-only step): runs ``graph`` (by default
    the bundle's model.fp16.onnx, the graph the plan was built from) on ONNX Runtime CPU, counting calls."""

    def __init__(self, graph):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.calls = 0

    def __call__(self, ids, mask):
        self.calls += 1
        return dict(zip(self.names, self.session.run(self.names, {"input_ids": ids, "attention_mask": mask})))


# --- the export --------------------------------------------------------------------------------------

def test_the_export_says_which_family_built_and_what_it_checked(exported):
    proc, _ = exported
    out = proc.stdout
    assert f"TensorRT engine model.plan: TensorRT-RTX {tensorrt_rtx.__version__} (--engine tensorrt-rtx), built in" in out
    assert "for GPUs of compute capability 8.6, 12.0" in out
    assert "precision walk passed (FP32 sites: layers.2.residual, layers.2.mlp, final_norm)" in out
    assert plan_status(" (") in out
    assert f"naive fp16 on TensorRT (reference only): TensorRT-RTX {tensorrt_rtx.__version__}: does not build: " in out


def test_engine_record_names_family_version_and_targets(exported):
    _, folder = exported
    m = open_bundle(folder).manifest  # verified: types, paths, seal, every file's sha256
    e = m.engine
    assert (e.family, e.version, e.targets) == ("tensorrt-rtx", tensorrt_rtx.__version__, RTX_EXPORT_TARGETS)
    assert (e.file, e.onnx, e.build_log) == ("model.plan", "model.fp16.onnx", "tensorrt_build.log")
    assert e.profiles == (Profile((1, 1), (16, 256), (32, 256)),)  # --max-batch 32 (default), --max-seq-len 256
    assert e.options.strongly_typed and not e.options.tf32 and not e.options.timing_cache
    assert e.options.workspace_gib > 1  # no cap by default: TensorRT's own limit, as its config reported it
    if GPU is None:
        assert e.built_on is None and e.validation is None and e.status == STATUS_NOT_RUN
        assert e.not_run_reason.startswith("built on a machine without a CUDA GPU")
    for name in ("model.plan", "tensorrt_build.log", "tensorrt_precision.json"):
        assert m.files[name].bytes == (folder / name).stat().st_size
    raw = json.loads((folder / "manifest.json").read_text())["engine"]
    assert raw["family"] == "tensorrt-rtx" and raw["targets"] == ["8.6", "12.0"] and raw["validation"] is None


def test_precision_walk_in_the_bundle_matches_the_plan(exported):
    _, folder = exported
    m = open_bundle(folder).manifest
    walk = m.engine.precision_walk
    _, plan = load_precision(folder / "precision.json")
    planned = {f"layers.{lp.layer}.{g}" for lp in plan.layers for g in ("residual", "attention", "mlp")
               if getattr(lp, g) == "float32"} | ({"final_norm"} if plan.final_norm == "float32" else set())
    assert walk.passed and walk.problems == () and set(walk.fp32_sites) == planned == FP32_SITES
    sites = {s.site: s for s in walk.sites}
    assert sites["layers.2.mlp"].tensorrt == "float32" and sites["layers.2.mlp"].compute_fp16 == 0
    assert sites["layers.0.mlp"].tensorrt == "float16" and walk.network.fp16_layers > 0 and walk.network.fp32_layers > 0
    saved = json.loads((folder / "tensorrt_precision.json").read_text())
    assert saved["passed"] and saved["table"] == walk.table() and len(saved["layers"]) == walk.network.layers
    naive = m.precision.naive_fp16_tensorrt  # beside ONNX Runtime's verdict on the same naive graph
    assert (naive.family, naive.parsed, naive.built) == ("tensorrt-rtx", True, False)
    assert "Error during shape inference" in naive.error
    assert m.precision.naive_fp16 is not None and not m.precision.naive_fp16.passed  # ONNX Runtime: non-finite


def test_mbert_run_info_describes_the_engine(exported):
    from mbert.runtime.cli import main

    _, folder = exported
    result = CliRunner().invoke(main, ["info", str(folder)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"TensorRT engine model.plan: TensorRT-RTX {tensorrt_rtx.__version__}, from model.fp16.onnx" in out
    assert f"runs on   GPUs of compute capability 8.6, 12.0 with TensorRT-RTX {tensorrt_rtx.__version__}" in out
    assert f"status    {plan_status(': ')}" in out
    assert "passed; compute layers fp16" in out and "kept FP32: layers.2.residual, layers.2.mlp, final_norm" in out
    assert "(details: tensorrt_precision.json)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1].isdigit() or
            line.startswith(("embeddings ", "final_norm "))}
    assert rows["2"][:3] == ["FP32:", "residual,", "mlp"] and rows["0"][0] == "fp16" and rows["final_norm"][0] == "FP32"
    assert "Found and reassigned Myelin backends for Self-Attention nodes" in out and "Layer(Myelin)" in out
    assert "naive fp16 on TensorRT (reference): TensorRT-RTX" in out


def test_triton_gets_no_tensorrt_model_for_an_rtx_plan(exported):
    _, folder = exported
    name = open_bundle(folder).manifest.triton.ensemble
    assert not (folder / "triton" / f"{name}_trt").exists()  # Triton's tensorrt_plan links datacenter TensorRT
    assert (folder / "triton_pending" / f"{name}_trt" / "config.pbtxt").is_file()
    readme = (folder / "triton" / "README.md").read_text()  # says why, and does not claim there is no plan
    assert "model.plan was built by TensorRT-RTX" in readme and "no model.plan yet" not in readme


# --- the runtime's rules for it ------------------------------------------------------------------------

def test_the_plan_is_refused_off_its_targets_and_accepted_on_them(exported):
    _, folder = exported
    bundle = open_bundle(folder)
    e = bundle.manifest.engine
    for cc in RTX_EXPORT_TARGETS:
        assert engine_compatibility(e, family_version=e.version, compute_capability=cc) == []
    (problem,) = engine_compatibility(e, family_version=e.version, compute_capability="8.9")
    assert problem == "GPU compute capability 8.9 is not among the plan's targets (8.6, 12.0)"
    with pytest.raises(BundleError, match=r"cannot run here: GPU compute capability 8.9 is not among the plan's targets"):
        check_engine(bundle, Gpu("NVIDIA GeForce RTX 4090", "8.9"))
    with pytest.raises(BundleError, match="cannot run here: no CUDA GPU"):
        check_engine(bundle, None)
    if GPU is None:  # the rules accept 8.6; TensorRT-RTX's own check (asked without a GPU) has the last word
        with pytest.raises(BundleError, match="TensorRT-RTX's validity check says INVALID"):
            check_engine(bundle, RTX_3090)
        assert open_backend(bundle, "auto").name == "onnxruntime-cpu"
        with pytest.raises(BundleError, match="no CUDA GPU"):
            open_backend(bundle, "tensorrt")
        (trt,) = [s for s in backend_statuses(bundle) if s.name == "tensorrt"]
        assert not trt.usable and trt.reason == "no CUDA GPU"


def test_first_open_runs_the_parity_grid_once_and_caches_the_verdict(exported, tmp_path):
    _, folder = exported
    bundle = open_bundle(folder)
    engine = StandInEngine(folder / "model.fp16.onnx")
    verdict = first_open_check(bundle, engine, RTX_3090, cache_dir=tmp_path)
    assert verdict.report.passed and engine.calls == len(verdict.report.cases) > 5
    assert verdict.plan_sha256 == bundle.manifest.files["model.plan"].sha256 and verdict.gpu == RTX_3090
    (saved,) = tmp_path.iterdir()
    assert from_json(EngineVerdict, json.loads(saved.read_text()), "") == verdict
    assert first_open_check(bundle, engine, RTX_3090, cache_dir=tmp_path) == verdict
    assert engine.calls == len(verdict.report.cases)  # cached: not run again on the same plan, GPU and release
    other = first_open_check(bundle, engine, RTX_5090, cache_dir=tmp_path)  # another GPU: its own run and verdict
    assert other.gpu == RTX_5090 and engine.calls == 2 * len(verdict.report.cases) and len(list(tmp_path.iterdir())) == 2
    open_bundle(folder)  # still verifies (every file hashed, none added): the runtime wrote nothing into the bundle


def test_a_plan_that_fails_its_first_run_is_refused_and_stays_refused(exported, tmp_path):
    _, folder = exported
    bundle = open_bundle(folder)
    write_naive_fp16(folder / "model.onnx", tmp_path / "naive.fp16.onnx")
    broken = StandInEngine(tmp_path / "naive.fp16.onnx")  # an engine computing the overflowing layer in FP16
    cache = tmp_path / "cache"
    with pytest.raises(EngineError, match=r"model.plan \(TensorRT-RTX .*\) failed the parity grid on NVIDIA GeForce RTX "
                                          r"3090 .*NON-FINITE.*The plan is refused"):
        first_open_check(bundle, broken, RTX_3090, cache_dir=cache)
    (saved,) = cache.iterdir()
    assert not from_json(EngineVerdict, json.loads(saved.read_text()), "").report.passed
    good = StandInEngine(folder / "model.fp16.onnx")
    with pytest.raises(EngineError, match="verdict cached in"):
        first_open_check(bundle, good, RTX_3090, cache_dir=cache)
    assert good.calls == 0


def test_a_plan_validated_on_this_capability_needs_no_first_run(exported, tmp_path):
    _, folder = exported
    bundle = open_bundle(folder)
    e = bundle.manifest.engine
    report = first_open_check(bundle, StandInEngine(folder / "model.fp16.onnx"), RTX_3090, cache_dir=tmp_path).report
    validated = replace(e, validation=EngineValidation(Gpu("NVIDIA RTX A6000", "8.6"), e.version, report),
                        not_run_reason=None)
    as_validated = replace(bundle, manifest=replace(bundle.manifest, engine=validated))
    untouched = StandInEngine(folder / "model.fp16.onnx")
    assert first_open_check(as_validated, untouched, RTX_3090, cache_dir=tmp_path / "other") is None
    assert untouched.calls == 0 and not (tmp_path / "other").exists()
    assert first_open_check(as_validated, untouched, RTX_5090, cache_dir=tmp_path / "other").report.passed
    assert untouched.calls == len(report.cases)
