"""Attention written once, lowered per target: each ONNX form equals the band-masked reference
(transformers' ModernBERT) on ONNX Runtime, the ONNX Runtime form keeps the fused kernel's input
form, the TensorRT form is what TensorRT's attention fusion recognizes, and every check can fail."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from helpers import hf_reference, make_checkpoint, random_batch
from onnx import TensorProto, helper, shape_inference

from mbert.bundle.errors import ExportError
from mbert.export.fp16.precision import LayerPlan, Plan, to_mixed_precision
from mbert.export.onnx.lowering import TARGET_INFO, TARGETS, standard_attention, translation_table
from mbert.export.onnx.trace import export_targets
from mbert.modeling import load_model
from mbert.modeling.graph import GraphModule
from mbert.runtime.backends.onnxruntime import onnx_runner

SMALL = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=2, intermediate_size=192, local_attention=16)
# right-padded batches around the block (8) and window (17) edges, padded rows in global layers too
LENGTHS = [[1], [9, 8, 7], [17, 16], [60, 33, 1], [130, 5]]
# ONNX Runtime FP32 vs transformers FP32: summation order only (measured ~3e-6 on these weights)
ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowering")
    folder = make_checkpoint(root / "ck", seed=21, **SMALL)
    model = load_model(folder)
    paths = {t: root / f"{t}.onnx" for t in TARGETS}
    export_targets(model, paths, max_seq_len=256)
    return model, hf_reference(folder), paths


def _max_error(run, ref, lengths, feed_mask=None) -> float:
    """Largest |ONNX - reference| over the real tokens of a right-padded batch."""
    ids, mask = random_batch(lengths, seed=sum(lengths))
    got = run(ids.numpy(), (mask if feed_mask is None else feed_mask(mask)).numpy())["last_hidden_state"]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    keep = mask.bool().numpy()
    return float(np.abs(got[keep] - want[keep]).max())


@pytest.mark.parametrize("target", TARGETS)
def test_form_matches_band_masked_reference(exported, target):
    _, ref, paths = exported
    run = onnx_runner(paths[target])
    for lengths in LENGTHS:
        assert _max_error(run, ref, lengths) < ATOL, (target, lengths)


@pytest.mark.parametrize("target", TARGETS)
def test_check_catches_a_dropped_padding_mask(exported, target):
    """The comparison can fail: the same graph fed no padding (mask of ones) misses on padded rows."""
    _, ref, paths = exported
    run = onnx_runner(paths[target])
    assert _max_error(run, ref, [60, 33, 1], feed_mask=torch.ones_like) > 100 * ATOL


def test_check_catches_fused_attention_that_ignores_padding(exported, tmp_path):
    """A fused lowering that drops the folded key bias (MultiHeadAttention on the raw q, k, v) is
    caught by the same comparison: padding in global layers is really carried by the folded column."""
    from mbert.export.onnx import lowering

    model, ref, _ = exported

    def unmasked(q, k, v, bias):
        if bias.shape[2] != 1:
            return standard_attention(q, k, v, bias)
        zero = lowering._ops().Mul(bias, lowering._ops().Constant(value_float=0.0))
        zero.shape = bias.shape  # the graph builder does not infer it
        return lowering.fused_attention(q, k, v, zero)

    graph = GraphModule(model, None).eval()
    ids, mask = random_batch([20, 9], seed=1)
    seq = torch.export.Dim("sequence", min=1, max=256)
    program = torch.onnx.export(graph, (ids, mask), None, dynamo=True, input_names=["input_ids", "attention_mask"],
                                output_names=["last_hidden_state"], custom_translation_table={
                                    torch.ops.mbert.attention.default: unmasked},
                                dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: seq},
                                                "attention_mask": {0: torch.export.Dim("batch"), 1: seq}})
    program.save(str(tmp_path / "broken.onnx"))
    run = onnx_runner(tmp_path / "broken.onnx")
    assert _max_error(run, ref, [1]) < ATOL  # unpadded: identical
    assert _max_error(run, ref, [60, 33, 1]) > 100 * ATOL


def test_onnxruntime_form_keeps_the_fused_kernel(exported):
    """One MultiHeadAttention per global layer, with no key_padding_mask / attention_bias input
    (either would select ONNX Runtime's unfused kernel), head dim + 1 for the folded bias."""
    model, _, paths = exported
    nodes = onnx.load(str(paths["onnxruntime"])).graph.node
    mha = [n for n in nodes if n.op_type == "MultiHeadAttention"]
    n_global = sum(layer.attn.is_global for layer in model.layers)
    assert len(mha) == n_global == 2
    assert all(n.domain == "com.microsoft" and len(n.input) == 3 for n in mha)
    attrs = {a.name: helper.get_attribute_value(a) for a in mha[0].attribute}
    assert attrs == {"num_heads": 2, "scale": 1.0}
    assert sum(n.op_type == "Softmax" for n in nodes) == len(model.layers) - n_global  # local layers
    assert TARGET_INFO["onnxruntime"].runtimes == ("onnxruntime",)


def test_tensorrt_form_is_standard_onnx(exported):
    model, _, paths = exported
    nodes = onnx.load(str(paths["tensorrt"])).graph.node
    assert {n.domain for n in nodes} <= {"", "ai.onnx"}
    assert sum(n.op_type == "Softmax" for n in nodes) == len(model.layers)
    assert set(TARGET_INFO["tensorrt"].runtimes) == {"tensorrt", "onnxruntime"}


def test_unknown_target_is_a_clear_error(exported, tmp_path):
    model, _, _ = exported
    with pytest.raises(ExportError, match="unknown ONNX target 'openvino'"):
        export_targets(model, {"openvino": tmp_path / "x.onnx"})
    with pytest.raises(KeyError):
        translation_table("openvino")


@pytest.fixture(scope="module")
def mixed(exported, tmp_path_factory):
    """Both forms of a mixed-precision model: layer 1's attention FP32, everything else FP16."""
    model, _, _ = exported
    plan = Plan(8.0, [LayerPlan(i) for i in range(len(model.layers))])
    plan.layers[1].attention = "float32"
    root = tmp_path_factory.mktemp("mixed")
    paths = {t: root / f"{t}.fp16.onnx" for t in TARGETS}
    export_targets(to_mixed_precision(model, plan), paths, max_seq_len=256)
    return paths


def _typed(path):
    model = shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    return g.node, types


def test_fp16_tensorrt_form_keeps_softmax_fp32_and_scores_fp16(mixed):
    """The plan's precision is in the graph: every softmax runs on FP32 input; the score MatMul
    of an FP16 layer is FP16 (the scan's attn.scores site), of the FP32 layer FP32."""
    nodes, types = _typed(mixed["tensorrt"])
    producer = {o: n for n in nodes for o in n.output}
    softmax = [n for n in nodes if n.op_type == "Softmax"]
    assert len(softmax) == 4 and all(types[n.input[0]] == TensorProto.FLOAT for n in softmax)
    score_types = []
    for n in softmax:  # Softmax(Add(Cast(scores), bias)); the optimizer drops the cast where scores are FP32
        add = producer[n.input[0]]
        scores = next(i for i in add.input if i in producer and producer[i].op_type in ("Cast", "MatMul"))
        cast = producer[scores]
        score_types.append(types[cast.input[0]] if cast.op_type == "Cast" else types[scores])
    assert score_types == [TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.FLOAT16]


def test_fp16_onnxruntime_form_runs_fused_attention_in_fp32(exported, mixed):
    """ONNX Runtime's CPU MultiHeadAttention is FP32 only: FP16 operands are cast around it; the
    graph runs and agrees with the FP32 model."""
    model, _, _ = exported
    nodes, types = _typed(mixed["onnxruntime"])
    assert all(types[i] == TensorProto.FLOAT for n in nodes if n.op_type == "MultiHeadAttention" for i in n.input)
    ids, mask = random_batch([60, 33, 1], seed=5)
    got = onnx_runner(mixed["onnxruntime"])(ids.numpy(), mask.numpy())["last_hidden_state"]
    with torch.no_grad():
        want = model(ids, mask).numpy()
    keep = mask.bool().numpy()
    a, b = got[keep], want[keep]
    cosine = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert np.isfinite(got).all() and cosine.min() > 0.9999  # FP16 rounding only


# ------------------------------------------------------------------ TensorRT's attention fusion
def _trt_build_log(path) -> tuple[bool, list[str]]:
    """Parse and build ``path`` with TensorRT-RTX (no GPU needed); (parsed, verbose log lines)."""
    trt = pytest.importorskip("tensorrt_rtx")
    lines: list[str] = []

    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            lines.append(msg)

    log = Log()
    builder = trt.Builder(log)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(path)):
        return False, lines
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name in ("input_ids", "attention_mask"):
        profile.set_shape(name, (1, 1), (2, 64), (4, 256))
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is not None, "\n".join(lines[-20:])
    return True, lines


def _fused_softmax(path) -> tuple[set[str], set[str]]:
    """(Softmax nodes of the graph, nodes TensorRT reported as part of a self-attention pattern)."""
    parsed, lines = _trt_build_log(path)
    assert parsed
    found = {m.group(1) for line in lines if (m := re.match(r"Found (\S+) to be part of self-attention pattern", line))}
    assert any("Found and reassigned Myelin backends for Self-Attention nodes" in line for line in lines) or not found
    softmax = {n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Softmax"}
    return softmax, found


@pytest.mark.parametrize("which", ["fp32", "fp16"])
def test_tensorrt_fuses_every_attention(exported, mixed, which):
    """TensorRT-RTX's builder reports every softmax of the TensorRT form (FP32, and the mixed FP16
    graph with its FP32 softmax casts) as part of a self-attention pattern."""
    path = exported[2]["tensorrt"] if which == "fp32" else mixed["tensorrt"]
    softmax, found = _fused_softmax(path)
    assert softmax and softmax <= found


def test_tensorrt_fusion_check_can_fail(exported, tmp_path):
    """The same check on a graph whose softmax is spelled out (Exp / ReduceSum / Div) finds no
    fused attention, and the ONNX Runtime form (contrib ops) does not even parse."""
    model = onnx.load(str(exported[2]["tensorrt"]))
    nodes = []
    for n in model.graph.node:
        if n.op_type != "Softmax":
            nodes.append(n)
            continue
        x, y, axes = n.input[0], n.output[0], n.name + "_axes"
        nodes += [helper.make_node("Constant", [], [axes], value=helper.make_tensor(axes, TensorProto.INT64, [1], [-1])),
                  helper.make_node("Exp", [x], [y + "_e"], name=n.name + "_exp"),
                  helper.make_node("ReduceSum", [y + "_e", axes], [y + "_s"], name=n.name + "_sum", keepdims=1),
                  helper.make_node("Div", [y + "_e", y + "_s"], [y], name=n.name)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(tmp_path / "spelled.onnx"))
    _, found = _fused_softmax(tmp_path / "spelled.onnx")
    assert not found
    parsed, _ = _trt_build_log(exported[2]["onnxruntime"])
    assert not parsed
