"""INT8 proven safe: the emulation is ONNX Runtime's arithmetic, the sensitivity plan finds a matrix made
sensitive on purpose and keeps it FP32, the blind quantization fails the validation there while ours
passes, and the INT8 graph runs integer kernels, stays finite on padded batches and is deterministic
through the runtime's ONNX Runtime backend."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from helpers import make_checkpoint, random_batch
from mbert.export.int8 import (
    S8_7BIT, Damage, Int8Plan, SensitivityReport, Site, _tail, emulated, load_int8, matrix_sites, plan,
    quantize_activation, quantize_weight,
)
from mbert.export.int8_check import (
    INT8_TOLERANCES, raise_if_failed, retrieval_split, run_int8, topk_agreement, validate_int8,
)
from mbert.export.int8_graph import integer_matmuls, kernels_run, matrix_nodes, quantize_graph
from mbert.export.onnx import GraphModule
from mbert.export.pipeline import ExportOptions, _Stages, export_bundle
from mbert.export.texts import calibration_texts
from mbert.export.validate import build_cases, default_grid, eager_runner, load_tokenizer, onnx_runner
from mbert.modeling import ValidationError, load_model, load_pooling

SMALL = dict(num_hidden_layers=3, hidden_size=128, num_attention_heads=2, intermediate_size=192, local_attention=16)
OUTLIER = (1, 5, 50.0)  # layer 1's mlp.Wi input: channel 5 fifty times the others (FP32 function unchanged)
MAX_LEN = 256
PLAN_LEN = 64  # calibration texts cut to 64 tokens for the plan: enough to see the outlier, fast


@pytest.fixture(scope="module")
def outlier(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=3, layout="mean-normalize",
                             outlier_channel=OUTLIER, **SMALL)
    bundle = export_bundle(folder, ExportOptions(out=root / "out", max_seq_len=MAX_LEN)).bundle
    model = load_model(folder)
    graph = GraphModule(model, load_pooling(folder)).eval()
    tok, cfg, texts = load_tokenizer(folder), model.config, calibration_texts()
    cases = build_cases(tok, texts, default_grid(cfg.window_half_width, MAX_LEN), cfg.cls_token_id,
                        cfg.sep_token_id, cfg.pad_token_id)
    work = root / "int8"
    work.mkdir()
    (work / "model.onnx").write_bytes((bundle / "model.onnx").read_bytes())
    reference = eager_runner(graph)
    outcome = run_int8(graph, tok, texts, cases, reference, work, MAX_LEN, texts, _Stages(lambda e, m: None, 4),
                       plan_max_len=PLAN_LEN)
    return dict(folder=folder, graph=graph, model=model, tok=tok, cases=cases, work=work, outcome=outcome,
                reference=reference, fp32=bundle / "model.onnx")


# --- the emulation is ONNX Runtime's arithmetic ----------------------------------------------------

def _dynamic_quantize_linear(x: np.ndarray):
    import onnxruntime as ort

    graph = helper.make_graph([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, list(x.shape)),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("z", TensorProto.UINT8, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_activation_quantization_equals_dynamic_quantize_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 40, generator=g) * 3 + 0.7
    x[1, 7, 3] = 41.0  # an outlier stretches the range
    for t in (x, x.abs() + 1, -x.abs(), torch.zeros(2, 3), x * 1e-3):
        y, s, z = _dynamic_quantize_linear(t.numpy())
        q, scale, zp = quantize_activation(t)
        assert np.array_equal(q.numpy().astype(np.uint8), y), t.shape
        assert float(scale) == float(s) and int(zp) == int(z)


def test_weight_quantization_equals_the_quantizer(outlier):
    """Our per-channel int8 weights and scales are the initializers ONNX Runtime's quantizer writes."""
    site = Site(1, "mlp.Wo")
    path = outlier["work"] / "one.onnx"
    quantize_graph(outlier["fp32"], path, [site], S8_7BIT)
    proto = onnx.load(str(path))
    node = next(n for n in proto.graph.node if n.name == matrix_nodes(outlier["fp32"])[site] + "_quant")
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    q, scale = quantize_weight(dict(matrix_sites(outlier["model"]))[site].weight, S8_7BIT)
    assert np.array_equal(inits[node.input[1]], q.t().numpy().astype(np.int8))  # B is W^T, [K, N]
    assert np.array_equal(inits[node.input[1].replace("_quantized", "_scale")], scale.numpy())
    assert float(q.abs().max()) <= 64  # 7-bit: no vpmaddubsw saturation on any x86 CPU


def test_seven_bit_weights_are_exact_on_worst_case_inputs():
    """The reason for 7-bit weights: with +-64 weights and uint8 activations at 255 the int32 result
    is exact on this CPU whatever its instruction set (full-range +-127 weights overflow a 16-bit
    pair sum without VNNI: see benchmarks/int8_cpu.py)."""
    import onnxruntime as ort

    K, N = 64, 8
    b = np.random.default_rng(0).integers(-64, 65, size=(K, N)).astype(np.int8)
    b[:, 0], b[:, 1] = 64, -64
    a = np.full((4, K), 255, dtype=np.uint8)
    g = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, K])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [4, N])],
                          [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(0, np.uint8), "za"),
                           numpy_helper.from_array(np.array(0, np.int8), "zb")])
    s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
    assert np.array_equal(s.run(None, {"a": a})[0], a.astype(np.int64) @ b.astype(np.int64))


def test_one_quantized_matrix_in_ort_equals_the_emulation(outlier):
    """The whole model with one INT8 matrix: ONNX Runtime vs the eager emulation differ by summation
    order only, a thousandth of what quantizing moved."""
    ids, mask = (t.numpy() for t in random_batch([150, 37, 5], seed=1))
    keep = mask.astype(bool)
    ref = outlier["reference"](ids, mask)
    for site in (Site(0, "attn.Wqkv"), Site(2, "mlp.Wi")):
        path = outlier["work"] / "one.onnx"
        quantize_graph(outlier["fp32"], path, [site], S8_7BIT)
        got = onnx_runner(path)(ids, mask)
        with emulated(outlier["model"], [site], S8_7BIT):
            emu = eager_runner(outlier["graph"])(ids, mask)
        for name in got:
            g, e, r = (a[keep] if a.ndim == 3 else a for a in (got[name], emu[name], ref[name]))
            moved = np.abs(e - r).max()
            assert moved > 1e-4, (site, name)  # quantization did something
            assert np.abs(g - e).max() < 1e-2 * moved, (site, name)


def test_tail_from_cached_layer_input_equals_the_forward(outlier):
    graph, model = outlier["graph"], outlier["model"]
    ids, mask = random_batch([90], seed=4)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.layers]
    with torch.no_grad():
        full = graph(ids, mask)
        for h in hooks:
            h.remove()
        for start in (0, 2):
            tail = _tail(graph, start, inputs[start], ids, mask)
            assert torch.equal(tail["last_hidden_state"], full[0]) and torch.equal(tail["sentence_embedding"], full[1])


# --- the plan finds the outlier; blind fails where ours passes -------------------------------------

def test_plan_keeps_the_outlier_matrix_fp32(outlier):
    p = outlier["outcome"].plan
    layer, _, _ = OUTLIER
    assert [s.name for s in p.fp32_sites()] == [f"layers.{layer}.mlp.Wi"]
    wi = next(m for m in p.matrices if m.site == f"layers.{layer}.mlp.Wi")
    others = [m for m in p.matrices if m.site != wi.site]
    assert wi.damage["last_hidden_state"] > 20 * max(m.damage["last_hidden_state"] for m in others)
    assert "alone moves" in wi.why
    assert all(v <= p.budget[k] for k, v in p.combined.items())


def test_ours_passes_where_blind_fails(outlier):
    v = outlier["outcome"].validation
    assert v["passed"] and v["retrieval"]["mean_agreement"] >= 0.95
    ours = {o["name"]: o for o in v["outputs"]}
    assert ours["sentence_embedding"]["worst_cosine"] >= 0.995
    for key, blind in v["blind"].items():
        assert not blind["passed"], key
        b = {o["name"]: o for o in blind["outputs"]}
        assert b["last_hidden_state"]["worst_cosine"] < INT8_TOLERANCES["last_hidden_state"].min_cosine, key


def test_blind_graph_raises_in_the_gate(outlier, tmp_path):
    path = tmp_path / "blind.onnx"
    quantize_graph(outlier["fp32"], path, None, S8_7BIT)
    tolerances = {n: INT8_TOLERANCES[n] for n in outlier["graph"].output_names}
    report, _ = validate_int8("blind", path, outlier["reference"], outlier["cases"][:3], tolerances, None)
    assert not report["passed"]
    with pytest.raises(ValidationError, match="last_hidden_state: worst cosine"):
        raise_if_failed(report)
    raise_if_failed(outlier["outcome"].validation)  # ours passes the same gate


def test_int8_json_and_plot(outlier):
    work = outlier["work"]
    p, doc = load_int8(work / "int8.json")
    assert p.to_dict() == outlier["outcome"].plan.to_dict()
    assert doc["validation"]["passed"] and "blind" in doc["validation"]
    assert doc["graph"]["weight_format"] == "s8-7bit" and doc["graph"]["per_channel"]
    assert (work / "int8.png").stat().st_size > 10_000


# --- the graph ------------------------------------------------------------------------------------

def test_profiler_shows_integer_kernels(outlier):
    kernels = load_int8(outlier["work"] / "int8.json")[1]["graph"]["kernels"]
    n_int8 = len(outlier["outcome"].plan.int8_sites())
    assert integer_matmuls(kernels) == n_int8 == 11
    ids, mask = (t.numpy() for t in random_batch([20], seed=3))
    assert integer_matmuls(kernels_run(outlier["fp32"], ids, mask)) == 0


def test_int8_graph_finite_on_heavily_padded_batches(outlier):
    run = onnx_runner(outlier["work"] / "model.int8.onnx")
    for lengths in ([3, 250], [250, 1, 1, 2], [1]):
        ids, mask = (t.numpy() for t in random_batch(lengths, seed=5))
        got, want = run(ids, mask), outlier["reference"](ids, mask)
        assert all(np.isfinite(a).all() for a in got.values())
        g, w = got["sentence_embedding"], want["sentence_embedding"]
        cos = (g * w).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(w, axis=-1)
        assert cos.min() >= 0.995, (lengths, cos)


def test_runtime_backend_runs_the_int8_graph_deterministically(outlier):
    """``precision='int8'`` will open OrtBackend on model.int8.onnx: its output equals a plain ONNX
    Runtime session's on the same inputs, and repeats exactly."""
    from mbert.runtime.backends import OrtBackend

    path = outlier["work"] / "model.int8.onnx"
    backend = OrtBackend(path, MAX_LEN, cuda=False, precision="int8")
    session = onnx_runner(path)
    ids, mask = (t.numpy() for t in random_batch([120, 64, 7], seed=6))
    a, b, c = backend.run(ids, mask), backend.run(ids, mask), session(ids, mask)
    for name in c:
        assert np.array_equal(a[name], b[name]) and np.array_equal(a[name], c[name]), name


# --- plan rules and the retrieval check -----------------------------------------------------------

def _report(damages: list[float]) -> SensitivityReport:
    sites = [Site(i, "mlp.Wi") for i in range(len(damages))]
    return SensitivityReport("s8-7bit", ["sentence_embedding"], sites,
                             [Damage({"sentence_embedding": d}) for d in damages], 1, 10, 10, 0.0)


def test_plan_rules():
    budget = 0.0025  # half of 1 - 0.995
    p = plan(_report([1e-4, 3e-3, 1.5e-3, 5e-4]))
    assert [m.precision for m in p.matrices] == ["int8", "float32", "int8", "int8"]
    assert "alone moves" in p.matrices[1].why
    p = plan(_report([1e-4, 3e-3, 2e-3, 5e-4]))  # 1e-4 + 5e-4 + 2e-3 > budget: the third waits
    assert [m.precision for m in p.matrices] == ["int8", "float32", "float32", "int8"]
    assert "summed damage" in p.matrices[2].why
    # the combined measurement says the sum underestimates: the most damaging matrices are dropped
    p = plan(_report([1e-4, 2e-4, 3e-4, 4e-4]), check=lambda sites: Damage({"sentence_embedding": 0.001 * len(sites)}))
    assert [m.precision for m in p.matrices] == ["int8", "int8", "float32", "float32"]
    assert "measured combined" in p.matrices[3].why and p.combined["sentence_embedding"] <= budget
    # ... or that it overestimates (worst cases of different matrices fall on different texts)
    p = plan(_report([1e-3, 1e-3, 1e-3, 3e-4]), check=lambda sites: Damage({"sentence_embedding": 4e-4 * len(sites)}))
    assert [m.precision for m in p.matrices] == ["int8", "int8", "int8", "int8"] and p.checks == 1
    assert Int8Plan.from_dict(p.to_dict()).to_dict() == p.to_dict()


def test_topk_agreement_can_fail():
    rng = np.random.default_rng(0)
    q, p = rng.standard_normal((20, 8)), rng.standard_normal((40, 8))
    assert topk_agreement(q, p, q, p).mean() == 1.0
    assert topk_agreement(q, p, q, rng.standard_normal((40, 8))).mean() < 0.5


def test_retrieval_split_is_deterministic(outlier):
    tok, cfg = outlier["tok"], outlier["model"].config
    q1, p1 = retrieval_split(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id)
    q2, p2 = retrieval_split(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id)
    assert np.array_equal(q1, q2) and np.array_equal(p1, p2) and len(q1) >= 100 and len(p1) >= 100
    assert (q1[:, 0] == cfg.cls_token_id).all() and (p1[:, -1] == cfg.sep_token_id).all()
