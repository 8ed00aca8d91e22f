"""INT8 proven safe: the emulation is ONNX Runtime's arithmetic, our graph writer is ONNX Runtime's
quantizer, the plan finds a matrix made sensitive on purpose and keeps it FP32 (by its damage alone,
and by the end-to-end check when the budget lets it through), the blind quantization fails the
validation there while ours passes, and the INT8 graph runs integer kernels and stays finite on
padded batches. The bundle is exported once, through ``mbert-export --int8`` (``helpers.Bundles.int8``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import OUTLIER, random_batch
from onnx import TensorProto, helper, numpy_helper

from mbert.bundle import open_bundle
from mbert.bundle.errors import PrecisionError
from mbert.bundle.int8 import Int8Record
from mbert.bundle.schema import from_json
from mbert.bundle.texts import calibration_texts
from mbert.bundle.tokenizer import load_tokenizer
from mbert.bundle.validation import INT8_TOLERANCES, build_cases, default_grid, tolerances_for
from mbert.export.int8.check import check_graph, retrieval_set, retrieval_split, topk_agreement
from mbert.export.int8.graph import integer_matmuls, kernels_run, quantize_graph, write_int8
from mbert.export.int8.plan import (
    S8,
    S8_7BIT,
    SensitivityReport,
    Site,
    _tail,
    budget_for,
    calibration_batches,
    combined_damage,
    emulated,
    fp32_reference,
    integer_product,
    longest_prefix,
    matrix_sites,
    quantize_activation,
    select,
)
from mbert.modeling import load_model, load_pooling
from mbert.modeling.graph import GraphModule, eager_runner
from mbert.runtime.backends.onnxruntime import onnx_runner

LAYER, _, _ = OUTLIER
WI = f"layers.{LAYER}.mlp.Wi"


@pytest.fixture(scope="module")
def ctx(bundles):
    """The CLI-exported INT8 bundle and what is needed to check graphs against its eager model."""
    folder, printed = bundles.int8()
    ck = bundles.checkpoint("outlier")
    model = load_model(ck)
    graph = GraphModule(model, load_pooling(ck)).eval()
    tok, cfg, m = load_tokenizer(ck), model.config, open_bundle(folder).manifest
    cases = build_cases(tok, calibration_texts(), default_grid(cfg.window_half_width, m.max_seq_len),
                        cfg.cls_token_id, cfg.sep_token_id, cfg.pad_token_id)
    return dict(folder=folder, printed=printed, manifest=m, model=model, graph=graph, tok=tok, cases=cases,
                reference=eager_runner(graph), fp32=folder / "model.onnx")


# --- the emulation is ONNX Runtime's arithmetic; our writer is its quantizer ----------------------

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


@pytest.mark.parametrize("fmt", [S8_7BIT, S8])
def test_integer_product_is_exact(fmt):
    """The emulated int32 sums equal exact integer arithmetic at the worst case (every partial sum at
    its largest), for a K long enough to need several float32 slices."""
    g = torch.Generator().manual_seed(1)
    K = 6000
    a = torch.randint(-255, 256, (4, K), generator=g).float()
    a[0] = 255.0
    w = torch.randint(-fmt.qmax, fmt.qmax + 1, (6, K), generator=g).float()
    w[0] = float(fmt.qmax)
    w[1:3] = torch.randint(1, fmt.qmax + 1, (2, K), generator=g).float()  # one-signed: sums far past 2**24
    want = a.long() @ w.long().t()
    assert torch.equal(integer_product(a, w, fmt.qmax), want.double())
    assert not torch.equal((a @ w.t()).double(), want.double())  # one float32 product would round


@pytest.mark.parametrize("fmt", [S8_7BIT, S8])
def test_write_int8_is_onnx_runtimes_quantizer(ctx, tmp_path, fmt):
    """Our graph (one DynamicQuantizeMatMul per matrix) and quantize_dynamic's give bit-identical outputs
    in ONNX Runtime, for a few matrices and for all of them."""
    ids, mask = (t.numpy() for t in random_batch([100, 37, 5], seed=2))
    for sites in ([Site(0, "attn.Wqkv"), Site(2, "mlp.Wo")], None):
        ours, theirs = tmp_path / "ours.onnx", tmp_path / "theirs.onnx"
        write_int8(ctx["fp32"], ours, sites, fmt)
        quantize_graph(ctx["fp32"], theirs, sites, fmt)
        a, b = onnx_runner(ours)(ids, mask), onnx_runner(theirs)(ids, mask)
        for name in a:
            assert np.array_equal(a[name], b[name]), (fmt.name, sites, name)
    import onnx

    inits = [numpy_helper.to_array(i) for i in onnx.load(str(ours)).graph.initializer if i.name.endswith("_W_int8")]
    assert max(int(np.abs(q.astype(np.int32)).max()) for q in inits) == fmt.qmax


def test_seven_bit_weights_are_exact_on_worst_case_inputs():
    """The reason for 7-bit weights: with +-64 weights and uint8 activations at 255 the int32 result is
    exact on this CPU whatever its instruction set (full-range +-127 weights overflow a 16-bit pair sum
    without VNNI: see benchmarks/int8_cpu.py)."""
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


def test_one_quantized_matrix_in_ort_equals_the_emulation(ctx, tmp_path):
    """The whole model with one INT8 matrix: ONNX Runtime vs the eager emulation differ by summation
    order only, a hundredth of what quantizing moved."""
    ids, mask = (t.numpy() for t in random_batch([110, 37, 5], seed=1))
    keep = mask.astype(bool)
    ref = ctx["reference"](ids, mask)
    for site in (Site(0, "attn.Wqkv"), Site(2, "mlp.Wi")):
        path = tmp_path / "one.onnx"
        write_int8(ctx["fp32"], path, [site], S8_7BIT)
        got = onnx_runner(path)(ids, mask)
        with emulated(ctx["model"], [site], S8_7BIT):
            emu = eager_runner(ctx["graph"])(ids, mask)
        for name in got:
            g, e, r = (a[keep] if a.ndim == 3 else a for a in (got[name], emu[name], ref[name]))
            moved = np.abs(e - r).max()
            assert moved > 1e-4, (site, name)  # quantization did something
            assert np.abs(g - e).max() < 1e-2 * moved, (site, name)


def test_tail_from_cached_layer_input_equals_the_forward(ctx):
    graph = ctx["graph"]
    ids, mask = random_batch([90], seed=4)
    ref = fp32_reference(graph, [(ids, mask)])
    for start in (0, 2):
        with torch.no_grad():
            tail = _tail(graph, start, ref.layer_inputs[0][start], ids, mask)
        for name, want in ref.outputs[0].items():
            assert torch.equal(tail[name], want), (start, name)


# --- the plan finds the outlier; blind fails where ours passes -------------------------------------

def test_plan_keeps_the_outlier_matrix_fp32(ctx):
    r = ctx["manifest"].int8
    assert r.fp32_sites() == (WI,)
    wi = next(m for m in r.matrices if m.site == WI)
    others = [m for m in r.matrices if m.site != WI]
    assert wi.damage["last_hidden_state"] > 20 * max(m.damage["last_hidden_state"] for m in others)
    assert wi.why.startswith("alone moves") and wi.precision == "fp32"
    assert all(v <= r.budget[k] for k, v in r.combined_damage.items())
    assert [c.int8_matrices for c in r.checks if c.passed] == [len(r.int8_sites())] == [11]


def test_the_end_to_end_check_keeps_it_fp32_when_the_budget_lets_it_through(ctx, tmp_path):
    """With a budget so loose that the outlier matrix is a candidate, the real graphs that contain it
    miss the end-to-end check and the plan keeps it FP32 anyway; every set it tried was checked."""
    graph, tok, cfg = ctx["graph"], ctx["tok"], ctx["model"].config
    ref = fp32_reference(graph, calibration_batches(tok, calibration_texts()))
    recorded = {m.site: m.damage for m in ctx["manifest"].int8.matrices}  # the export's solo measurements
    sites = tuple(s for s, _ in matrix_sites(ctx["model"]))
    report = SensitivityReport("s8-7bit", graph.output_names, sites, tuple(recorded[s.name] for s in sites), 0, 0, 0.0)
    loose = {k: 1.0 for k in budget_for(graph.output_names)}
    names, tried = graph.output_names, []
    rs = retrieval_set(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id, 128, onnx_runner(ctx["fp32"]),
                       names)

    def end_to_end(chosen):
        path = tmp_path / f"c{len(chosen)}.onnx"
        write_int8(ctx["fp32"], path, chosen)
        c = check_graph("candidate", path, ctx["reference"], ctx["cases"], tolerances_for("int8", names), rs,
                        fail_fast=True)
        tried.append((len(chosen), Site(LAYER, "mlp.Wi") in chosen, c.passed))
        return c.passed, c.detail()

    sel = select(report, loose, lambda s: combined_damage(graph, ref, s, S8_7BIT), end_to_end)
    assert [m.site for m in sel.matrices if m.precision == "fp32"] == [WI]
    assert "end-to-end check missed" in next(m.why for m in sel.matrices if m.site == WI)
    assert all(not passed for _, has_wi, passed in tried if has_wi)
    assert (len(sel.chosen), False, True) in tried and len(sel.chosen) == 11
    assert [(c.int8_matrices, c.passed) for c in sel.checks] == [(n, ok) for n, _, ok in tried]


def test_ours_passes_where_blind_fails(ctx):
    m = ctx["manifest"]
    ours, r = m.graph("int8").validation, m.int8
    assert ours.passed and r.retrieval.passed and r.retrieval.mean_agreement >= 0.95
    got = {o.name: o for o in ours.outputs}
    assert got["sentence_embedding"].worst_cosine >= INT8_TOLERANCES["sentence_embedding"].min_cosine
    assert {b.name for b in r.blind} == {"sentence-transformers avx512_vnni", "all matrices, 7-bit weights"}
    for b in r.blind:
        assert b.error is None and not b.validation.passed, b.name
        blind = {o.name: o for o in b.validation.outputs}
        assert blind["last_hidden_state"].worst_cosine < INT8_TOLERANCES["last_hidden_state"].min_cosine, b.name
        assert b.retrieval.mean_agreement < r.retrieval.mean_agreement, b.name


def test_int8_json_plot_and_cli_summary(ctx):
    folder, m = ctx["folder"], ctx["manifest"]
    doc = json.loads((folder / "int8.json").read_text())
    assert from_json(Int8Record, doc["record"], "record") == m.int8
    assert doc["graph"]["weight_format"] == "s8-7bit" and doc["graph"]["per_channel"]
    assert WI not in doc["graph"]["nodes"] and len(doc["graph"]["nodes"]) == 11
    assert (folder / "int8.png").stat().st_size > 10_000
    printed = ctx["printed"]
    for needle in ("INT8 sensitivity plan", "model.int8.onnx", "blind int8, sentence-transformers avx512_vnni "
                   "(reference only)", "would FAIL", "top-10 neighbour agreement", f"FP32 (1): {WI} (alone moves"):
        assert needle in printed, needle


def test_profiler_shows_integer_kernels(ctx):
    m = ctx["manifest"]
    assert m.int8.integer_kernels == len(m.int8.int8_sites()) == 11
    ids, mask = (t.numpy() for t in random_batch([20], seed=3))
    assert integer_matmuls(kernels_run(ctx["folder"] / "model.int8.onnx", ids, mask)) == 11
    assert integer_matmuls(kernels_run(ctx["fp32"], ids, mask)) == 0


def test_int8_graph_finite_on_heavily_padded_batches(ctx):
    run = onnx_runner(ctx["folder"] / "model.int8.onnx")
    for lengths in ([3, 128], [128, 1, 1, 2], [1], [2] * 7 + [128]):
        ids, mask = (t.numpy() for t in random_batch(lengths, seed=5))
        got, want = run(ids, mask), ctx["reference"](ids, mask)
        assert all(np.isfinite(a).all() for a in got.values())
        g, w = got["sentence_embedding"], want["sentence_embedding"]
        cos = (g * w).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(w, axis=-1)
        assert cos.min() >= INT8_TOLERANCES["sentence_embedding"].min_cosine, (lengths, cos)


# --- plan rules and the retrieval check -----------------------------------------------------------

def _report(damages: list[float]) -> SensitivityReport:
    sites = tuple(Site(i, "mlp.Wi") for i in range(len(damages)))
    return SensitivityReport("s8-7bit", ("sentence_embedding",), sites,
                             tuple({"sentence_embedding": d} for d in damages), 1, 10, 0.0)


def test_plan_rules():
    budget = {"sentence_embedding": 0.0025}
    additive = lambda s: {"sentence_embedding": 8e-4 * len(s)}  # noqa: E731
    always = lambda s: (True, "")  # noqa: E731
    sel = select(_report([1e-4, 3e-3, 1.5e-3, 5e-4]), budget, additive, always)
    assert [m.precision for m in sel.matrices] == ["int8", "fp32", "int8", "int8"]
    assert sel.matrices[1].why.startswith("alone moves sentence_embedding by 3.00e-03")
    assert [c.int8_matrices for c in sel.checks] == [3]
    # the measured combination passes the budget with a fourth: the most damaging waits
    sel = select(_report([1e-4, 2e-4, 3e-4, 4e-4]), budget, additive, always)
    assert [m.precision for m in sel.matrices] == ["int8", "int8", "int8", "fp32"]
    assert "passes the budget" in sel.matrices[3].why
    # the end-to-end check fails with more than two: bisection, every answer checked
    sel = select(_report([1e-4, 2e-4, 3e-4, 4e-4, 5e-4]), {"sentence_embedding": 1.0}, additive,
                 lambda s: (len(s) <= 2, "top-10 neighbour agreement 0.9 < 0.95"))
    assert [m.precision for m in sel.matrices] == ["int8", "int8", "fp32", "fp32", "fp32"]
    assert "end-to-end check missed with it (top-10" in sel.matrices[2].why
    assert [(c.int8_matrices, c.passed) for c in sel.checks] == [(5, False), (2, True), (3, False)]
    with pytest.raises(PrecisionError, match="no INT8 set passes the end-to-end check"):
        select(_report([1e-4, 2e-4]), budget, additive, lambda s: (False, "worse"))
    with pytest.raises(PrecisionError, match="no matrix can run INT8"):
        select(_report([1.0, 2.0]), budget, additive, always)


def test_longest_prefix_asks_what_it_returns():
    for limit in range(0, 9):
        asked = []

        def ok(k, limit=limit):
            asked.append(k)
            return k <= limit

        k = longest_prefix(8, ok, guess=3)
        assert k == limit and (k == 0 or k in asked) and 0 not in asked


def test_topk_agreement_can_fail():
    rng = np.random.default_rng(0)
    q, p = rng.standard_normal((20, 8)), rng.standard_normal((40, 8))
    assert topk_agreement(q, p, q, p).mean() == 1.0
    assert topk_agreement(q, p, q, rng.standard_normal((40, 8))).mean() < 0.5


def test_retrieval_split_is_deterministic_and_fits_the_bundle(ctx):
    tok, cfg = ctx["tok"], ctx["model"].config
    q1, p1 = retrieval_split(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id, 512)
    q2, p2 = retrieval_split(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id, 512)
    assert np.array_equal(q1, q2) and np.array_equal(p1, p2) and len(q1) >= 100 and len(p1) >= 100
    assert (q1[:, 0] == cfg.cls_token_id).all() and (p1[:, -1] == cfg.sep_token_id).all()
    q, p = retrieval_split(tok, calibration_texts(), cfg.cls_token_id, cfg.sep_token_id, 20)
    assert q.shape[1] == p.shape[1] == 20


def test_int8_export_of_a_head_checkpoint(bundles, tmp_path):
    """A masked-LM checkpoint: logits judged by the INT8 logits tolerance, no retrieval check (no
    embedding); its tied decoder (no constant weight in the graph) stays FP32 with the reason."""
    from mbert.export.options import ExportOptions
    from mbert.export.pipeline import export_bundle

    m = export_bundle(bundles.checkpoint("mlm"), ExportOptions(out=tmp_path / "b", max_seq_len=64, int8=True)).manifest
    r, v = m.int8, m.graph("int8").validation
    assert r.retrieval is None and all(b.retrieval is None for b in r.blind)
    assert v.passed and [o.name for o in v.outputs] == ["logits"]
    assert v.outputs[0].tolerance == INT8_TOLERANCES["logits"] and set(r.budget) == {"logits"}
    sites = {x.site: x for x in r.matrices}
    assert set(sites) == {"layers.0.attn.Wqkv", "layers.0.attn.Wo", "layers.0.mlp.Wi", "layers.0.mlp.Wo",
                          "head.dense", "decoder"}
    assert sites["decoder"].precision == "fp32" and "not a MatMul with a constant weight" in sites["decoder"].why
    assert sites["head.dense"].damage and all(x.precision == "int8" or x.why for x in sites.values())
    assert open_bundle(tmp_path / "b").manifest == m


def test_cli_int8_export_fails_in_one_line_when_no_matrix_can_run_int8(bundles, tmp_path):
    """The token-classification test head (3 labels, random weights): every matrix alone moves its
    3-wide logits past the budget, so there is no INT8 graph to ship: exit 1, one line saying why,
    nothing written."""
    from click.testing import CliRunner

    from mbert.export.cli import main

    out = tmp_path / "b"
    result = CliRunner().invoke(main, [str(bundles.checkpoint("tokcls")), "--int8", "--out", str(out),
                                       "--max-seq-len", "64"])
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "no matrix can run INT8" in lines[0] and "export without --int8" in lines[0]
    assert not out.exists() and not any(p.name.startswith(".b.partial") for p in tmp_path.iterdir())
