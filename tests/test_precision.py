"""FP16 proven safe: the scan finds the overflowing layer, the plan keeps exactly it in FP32, the
mixed-precision graph stays finite and accurate where a naive FP16 conversion breaks."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import SMALL, make_checkpoint, random_batch
from onnx import TensorProto, numpy_helper

from mbert.bundle.errors import PrecisionError
from mbert.export.fp16.precision import (
    FP16_MAX,
    LayerPlan,
    Plan,
    ScanReport,
    SiteStat,
    load_precision,
    plan,
    scan,
    to_mixed_precision,
)
from mbert.export.options import ExportOptions
from mbert.export.pipeline import export_bundle
from mbert.modeling import Pooling, load_model, load_pooling
from mbert.runtime.backends.onnxruntime import onnx_runner

OVERFLOW_LAYER = 1
# Layer 1's MLP output matrix x30000: its output and the residual stream after it reach ~9e4,
# past FP16's 65504, while FP32 handles them exactly.
SCALE = 30000.0


@pytest.fixture(scope="module")
def overflow_export(tmp_path_factory):
    """(checkpoint, ExportResult, the (event, message) reports of the export)."""
    root = tmp_path_factory.mktemp("ovf")
    folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=31, layout="mean-normalize",
                             num_hidden_layers=4, scale_layer_mlp=(OVERFLOW_LAYER, SCALE), **SMALL)
    events: list[tuple[str, str]] = []
    result = export_bundle(folder, ExportOptions(out=root / "out", max_seq_len=1024, fp16=True, engine="none"),
                           lambda event, message: events.append((event, message)))
    return folder, result, events


@pytest.fixture(scope="module")
def overflow_bundle(overflow_export):
    return overflow_export[:2]


def test_the_traces_run_in_the_background_and_report_their_own_times(overflow_export):
    _, result, events = overflow_export
    stages = [m.split("] ", 1)[1] for e, m in events if e == "stage"]
    assert stages == ["load", "trace", "scan", "mixed precision", "validate", "validate fp16", "engine", "write"]
    started = [m.split(":")[0] for e, m in events if e == "started"]
    assert started == ["trace", "mixed precision"]  # the stages that start a job say so, not "done"
    background = dict(m.split(": ", 1) for e, m in events if e == "background")
    assert set(background) == {"trace", "mixed precision"}
    for times in background.values():  # "12.3 s wall, 11.9 s CPU": the child's own, both real
        wall, cpu = (float(part.split()[0]) for part in times.split(", "))
        assert wall > 0.5 and cpu > 0.5
    # the job's time is its own: the stage that started it returned at once
    assert result.timings["trace"] < float(background["trace"].split()[0])
    assert (result.bundle / "model.onnx").exists() and (result.bundle / "model.fp16.onnx").exists()


def test_fp32_model_is_fine_but_fp16_residual_overflows(overflow_bundle):
    folder, _ = overflow_bundle
    model = load_model(folder)
    ids, mask = random_batch([200], seed=1)
    with torch.no_grad():
        out = model(ids, mask)
        report = scan(model, [(ids, mask)])
    assert torch.isfinite(out).all()
    assert report.get(OVERFLOW_LAYER, "resid_mlp").max_abs > FP16_MAX  # would be inf in FP16
    assert report.get(0, "resid_mlp").max_abs < 100
    from_texts = scan(model, ["It's time for tea.", "A longer text about tea. " * 40], max_len=128)  # the API
    assert from_texts.num_texts == 2 and from_texts.max_len <= 128
    assert from_texts.get(OVERFLOW_LAYER, "resid_mlp").max_abs > FP16_MAX


def test_plan_names_the_layer(overflow_bundle):
    _, result = overflow_bundle
    report, p = load_precision(result.bundle / "precision.json")
    assert (OVERFLOW_LAYER, "mlp.Wo") in [(d.layer, d.site) for d in p.decisions]
    lp = p.layers[OVERFLOW_LAYER]
    assert lp.mlp == "float32" and lp.residual == "float32"
    assert p.layers[0] == LayerPlan(0)  # the layer before the overflow stays all FP16
    assert all(p.layers[i].attention == "float16" for i in range(4))  # attention never needed FP32
    assert result.manifest.precision.fp32_layers == (1, 2, 3)


def test_ours_finite_and_accurate_where_naive_breaks(overflow_bundle):
    _, result = overflow_bundle
    m = result.manifest
    v = m.graph("fp16").validation
    assert v.passed
    ours = {o.name: o for o in v.outputs}
    assert ours["sentence_embedding"].finite and ours["sentence_embedding"].worst_cosine >= 0.9999
    naive = {o.name: o for o in m.precision.naive_fp16.outputs}
    assert not naive["sentence_embedding"].finite or naive["sentence_embedding"].worst_cosine < 0.9
    assert not naive["last_hidden_state"].finite
    assert set(m.precision.per_layer_kind) == {"global", "local"}
    # the note telling how to build the engine later names the bundle, never the staging folder
    assert f"mbert-export --engine-only {result.bundle}" in result.engine_note and "partial" not in result.engine_note


def test_heavily_padded_fp16_batch_is_finite(overflow_bundle):
    folder, result = overflow_bundle
    ids, mask = random_batch([3, 600], seed=2)
    out = onnx_runner(result.bundle / "model.fp16.onnx")(ids.numpy(), mask.numpy())
    assert all(np.isfinite(a).all() for a in out.values())
    model, pooling = load_model(folder), load_pooling(folder)
    with torch.no_grad():
        want = Pooling.of(pooling)(model(ids, mask), mask).numpy()
    got = out["sentence_embedding"]
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.9999


def test_mixed_graph_types(overflow_bundle):
    _, result = overflow_bundle
    g = onnx.load(str(result.bundle / "model.fp16.onnx")).graph
    assert all(i.type.tensor_type.elem_type == TensorProto.INT64 for i in g.input)
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in g.output)
    kinds = {i.data_type for i in g.initializer}
    assert TensorProto.FLOAT16 in kinds and TensorProto.FLOAT in kinds  # mixed, by the plan
    assert sum(n.op_type == "Cast" for n in g.node) > 10
    for init in g.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype == np.float16:
            assert np.isfinite(arr).all() and np.abs(arr).max() <= FP16_MAX, init.name


def test_mixed_model_dtypes_follow_plan(overflow_bundle):
    folder, result = overflow_bundle
    _, p = load_precision(result.bundle / "precision.json")
    mixed = to_mixed_precision(load_model(folder), p)
    layer0, layer1 = mixed.layers[0], mixed.layers[OVERFLOW_LAYER]
    assert layer0.attn.Wqkv.weight.dtype == torch.float16 and layer0.mlp_norm.weight.dtype == torch.float16
    assert layer1.mlp.Wo.weight.dtype == torch.float32 and layer1.mlp_norm.weight.dtype == torch.float32
    assert layer1.attn.Wqkv.weight.dtype == torch.float16
    assert mixed.global_inv_freq.dtype == torch.float32  # RoPE tables stay FP32


def test_precision_json_round_trip(overflow_bundle, tmp_path):
    from mbert.export.fp16.precision import save_precision

    _, result = overflow_bundle
    report, p = load_precision(result.bundle / "precision.json")
    save_precision(tmp_path / "p.json", report, p)
    report2, p2 = load_precision(tmp_path / "p.json")
    assert report2.to_dict() == report.to_dict() and p2.to_dict() == p.to_dict()
    assert (result.bundle / "precision.png").stat().st_size > 10_000


def test_plan_rules():
    stats = [SiteStat(0, "attn.scores", 9000.0, 10.0), SiteStat(0, "mlp.Wi", 8000.0, 10.0),
             SiteStat(1, "resid_in", 5.0, 1.0), SiteStat(None, "embeddings", 3.0, 1.0)]
    p = plan(ScanReport(stats, 1, 10, 10), margin=8.0)  # limit 8188
    assert p.layers[0].attention == "float32" and p.layers[0].mlp == "float16"
    assert p.layers[1] == LayerPlan(1)
    assert plan(ScanReport(stats, 1, 10, 10), margin=4.0).layers[0].attention == "float16"  # limit 16376
    with pytest.raises(PrecisionError):
        plan(ScanReport(stats, 1, 10, 10), margin=0.5)
    assert Plan.from_dict(p.to_dict()).to_dict() == p.to_dict()


def test_cli_fp16_prints_scan_and_engine_note(rtx_export):
    """``mbert-export CK --fp16 --max-seq-len 256 --engine tensorrt-rtx`` (conftest's ``rtx_export``:
    layer 2's MLP output x30000, as SCALE here; its engine is tested in test_tensorrt_bundle.py)."""
    proc, _folder, out = rtx_export
    assert "FP16 overflow scan" in proc.stdout and "FP32 decisions: layer 2: mlp.Wo" in proc.stdout
    assert "model.fp16.onnx" in proc.stdout and "naive fp16" in proc.stdout
    assert "TensorRT engine model.plan: TensorRT-RTX" in proc.stdout
    assert (out / "triton").is_dir()


def test_naive_conversion_of_the_mixed_graph_is_the_naive_fp32_conversion(tmp_path):
    """The export converts the mixed graph naively (its FP32 ``model.onnx`` is in ONNX Runtime's fused
    form, which TensorRT cannot parse): the converter turns the plan's FP32 islands into FP16 too, so
    the result has the same operations as the naive conversion of the standard FP32 graph (casts
    aside) and the same outputs to 2 FP16 ulps, while the FP32 graph itself is farther than that."""
    import collections

    from mbert.export.fp16.naive import write_naive_fp16
    from mbert.export.fp16.precision import LayerPlan, Plan
    from mbert.export.onnx.trace import to_onnx

    model = load_model(make_checkpoint(tmp_path / "ck", seed=5, num_hidden_layers=3, **SMALL))
    to_onnx(model, tmp_path / "fp32.onnx", max_seq_len=512, target="tensorrt")
    plan = Plan(8.0, [LayerPlan(i, residual="float32" if i == 1 else "float16", mlp="float32" if i == 1 else "float16")
                      for i in range(model.config.num_hidden_layers)])
    to_onnx(to_mixed_precision(model, plan), tmp_path / "mixed.onnx", max_seq_len=512, target="tensorrt")
    write_naive_fp16(tmp_path / "fp32.onnx", tmp_path / "naive_fp32.onnx")
    write_naive_fp16(tmp_path / "mixed.onnx", tmp_path / "naive_mixed.onnx")

    def ops(name):
        return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / name)).graph.node if n.op_type != "Cast")

    assert ops("naive_fp32.onnx") == ops("naive_mixed.onnx")
    ids, mask = random_batch([300, 17, 120], seed=3)
    keep = mask.bool().numpy()
    out = {n: onnx_runner(tmp_path / f"{n}.onnx")(ids.numpy(), mask.numpy())["last_hidden_state"][keep]
           for n in ("naive_fp32", "naive_mixed", "fp32")}
    two_ulps = 2 * float(np.spacing(np.float16(np.abs(out["naive_fp32"]).max())))
    assert np.abs(out["naive_fp32"] - out["naive_mixed"]).max() <= two_ulps
    assert np.abs(out["naive_fp32"] - out["fp32"]).max() > two_ulps  # the comparison can fail
