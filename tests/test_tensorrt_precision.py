"""The precision walk over TensorRT-RTX's parsed network (real parser, no GPU): on the overflow
checkpoint the sites the plan keeps FP32 are FP32 in TensorRT's network and the rest computes in
FP16; the walk fails on a wrong plan, on the naive FP16 graph and on the FP32 graph."""
from __future__ import annotations

import copy
import json
import re

import onnx
import pytest
import tensorrt_rtx
from trt_helpers import OVERFLOW_LAYER, overflow_graphs

from mbert.bundle.engine import PrecisionWalk
from mbert.bundle.errors import PrecisionError
from mbert.bundle.schema import from_json, to_json
from mbert.export.fp16.precision import Plan
from mbert.export.onnx.scopes import node_scopes
from mbert.export.tensorrt.build import parse_onnx
from mbert.export.tensorrt.precision import expected_precision, save_walk, walk_parsed, walk_precision


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    return overflow_graphs(tmp_path_factory)


@pytest.fixture(scope="module")
def walk(graphs):
    return walk_precision(graphs.fp16, graphs.plan, family="tensorrt-rtx")


def plan_fp32_sites(plan: Plan) -> set[str]:
    sites = {f"layers.{lp.layer}.{g}" for lp in plan.layers for g in ("residual", "attention", "mlp")
             if getattr(lp, g) == "float32"}
    return sites | ({"final_norm"} if plan.final_norm == "float32" else set()) \
        | ({"embeddings"} if plan.layers[0].residual == "float32" else set())


def test_the_plan_keeps_the_overflowing_layer_fp32(graphs):
    lp = graphs.plan.layers[OVERFLOW_LAYER]
    assert lp.mlp == "float32" and lp.residual == "float32" and lp.attention == "float16"
    assert plan_fp32_sites(graphs.plan) == {"layers.1.residual", "layers.1.mlp", "layers.2.residual", "final_norm"}


def test_layers_kept_fp32_are_fp32_in_tensorrts_network(walk, graphs):
    assert walk.passed, walk.table()
    assert walk.family == "tensorrt-rtx" and walk.version == tensorrt_rtx.__version__
    sites = {s.site: s for s in walk.sites}
    assert set(walk.fp32_sites) == plan_fp32_sites(graphs.plan)
    assert set(sites) == {"embeddings", "final_norm"} | {f"layers.{i}.{g}" for i in range(3)
                                                         for g in ("residual", "attention", "mlp")}
    mlp1 = sites["layers.1.mlp"]
    assert (mlp1.tensorrt, mlp1.defining_fp32, mlp1.defining_fp16, mlp1.compute_fp16) == ("float32", 2, 0, 0)
    for i in (0, 2):  # FP16 MLPs: both matrix products (Wi, Wo) in FP16
        assert (sites[f"layers.{i}.mlp"].tensorrt, sites[f"layers.{i}.mlp"].defining_fp16) == ("float16", 2)
    # attention matrix products: Wqkv, Wo and q k^T, p v (all heads at once, global and local layers alike)
    assert all(sites[f"layers.{i}.attention"].defining_fp16 == 4 for i in range(3))
    for i in range(3):  # softmax statistics and RoPE stay FP32 inside FP16 attention
        att = sites[f"layers.{i}.attention"]
        assert att.tensorrt == "float16" and att.compute_fp32 > 0
    assert sites["layers.2.residual"].compute_fp16 == 0 and sites["layers.0.residual"].defining_fp16 == 2
    n = walk.network  # every compute layer is placed (shape helpers may stay unplaced: they compute nothing)
    assert n.fp16_layers > 0 and walk.unplaced == {} and n.placed_by_metadata > 0 and n.placed_by_connection > 0
    assert n.placed_by_metadata + n.placed_by_connection + n.outside + n.unplaced == n.layers
    rows = walk.per_layer()
    assert [r[0] for r in rows] == ["embeddings", "0", "1", "2", "final_norm"]
    assert rows[2][1] == "FP32: residual, mlp" and rows[3][1] == "FP32: residual" and rows[1][1] == "fp16"


def test_tensorrt_layers_are_named_after_onnx_nodes(graphs):
    """The mapping's premise: TensorRT's ONNX parser names layers after their nodes (a suffix for the
    extra layers of one node) and records the node in the layer's metadata."""
    parsed = parse_onnx(graphs.fp16, "tensorrt-rtx")
    proto = onnx.load(str(graphs.fp16), load_external_data=False)
    names = {n.name for n in proto.graph.node}
    scopes = node_scopes(proto)
    with_metadata = 0
    for i in range(parsed.network.num_layers):
        layer = parsed.network.get_layer(i)
        nodes = re.findall(r"\[ONNX Layer: ([^\]]+)\]", layer.metadata)
        if nodes:
            with_metadata += 1
            assert set(nodes) <= names and (layer.name in nodes or layer.name.startswith(nodes[0] + "_")), layer.name
    matmuls = {parsed.network.get_layer(i).name for i in range(parsed.network.num_layers)
               if parsed.network.get_layer(i).type == tensorrt_rtx.LayerType.MATRIX_MULTIPLY}
    assert matmuls and matmuls <= set(scopes)  # every matrix product is an exporter node with a scope
    assert with_metadata > len(names) // 2


def test_walk_fails_on_a_wrong_plan(graphs):
    wrong = copy.deepcopy(graphs.plan)
    wrong.layers[OVERFLOW_LAYER].mlp = "float16"  # the plan claims FP16 where the graph is FP32
    wrong.layers[0].attention = "float32"  # and FP32 where the graph is FP16
    result = walk_precision(graphs.fp16, wrong, family="tensorrt-rtx")
    assert not result.passed
    failed = {s.site: s.why for s in result.sites if not s.passed}
    assert set(failed) == {"layers.1.mlp", "layers.0.attention"}
    assert failed["layers.1.mlp"].startswith("the plan puts it in FP16 but its matrix products are float32")
    assert failed["layers.0.attention"].startswith("the plan keeps it FP32 but")
    with pytest.raises(PrecisionError, match=r"TensorRT's network disagrees with the FP16 plan .*layers.1.mlp"):
        result.raise_if_failed()
    shorter = copy.deepcopy(graphs.plan)
    shorter.layers = shorter.layers[:2]  # TensorRT has a layer the plan lacks
    short = walk_precision(graphs.fp16, shorter, family="tensorrt-rtx")
    assert "layers.2.mlp: the plan has no such site" in short.problems


def test_walk_fails_on_graphs_that_disagree_with_the_plan(graphs):
    naive = walk_precision(graphs.naive, graphs.plan, family="tensorrt-rtx")  # everything FP16
    assert {s.site for s in naive.sites if not s.passed} == plan_fp32_sites(graphs.plan)
    assert all(s.tensorrt == "float16" for s in naive.sites)
    fp32 = walk_precision(graphs.fp32, graphs.plan, family="tensorrt-rtx")  # everything FP32
    assert {s.site for s in fp32.sites if not s.passed} == {s.site for s in fp32.sites} - plan_fp32_sites(graphs.plan)
    assert all(s.tensorrt == "float32" for s in fp32.sites)


def test_walk_is_a_typed_record_and_its_file_lists_every_layer(graphs, tmp_path):
    walk, listing = walk_parsed(parse_onnx(graphs.fp16, "tensorrt-rtx"), graphs.plan)
    assert from_json(PrecisionWalk, json.loads(json.dumps(to_json(walk))), "walk") == walk  # the manifest's form
    save_walk(tmp_path / "tensorrt_precision.json", walk, listing)
    data = json.loads((tmp_path / "tensorrt_precision.json").read_text())
    assert data["passed"] and data["problems"] == [] and data["onnx"] == "model.fp16.onnx"
    assert len(data["layers"]) == walk.network.layers and data["table"] == walk.table()
    mlp1 = [x for x in data["layers"] if x["site"] == "layers.1.mlp" and x["type"] == "MATRIX_MULTIPLY"]
    assert len(mlp1) == 2 and all(x["dtypes"] == ["float32"] for x in mlp1)
    lines = walk.table()
    assert lines[0].endswith("passed") and any(re.match(r"layers\.1\.mlp\s+fp32\s+fp32\s+0\s+\d+\s+ok", x) for x in lines)


def test_expected_precision_reads_the_plan(graphs):
    p = graphs.plan
    assert expected_precision(p, "layers.1.mlp") == "float32" and expected_precision(p, "layers.0.mlp") == "float16"
    assert expected_precision(p, "final_norm") == "float32" and expected_precision(p, "head") == "float16"
    assert expected_precision(p, "embeddings") == p.layers[0].residual
    assert expected_precision(p, "layers.7.mlp") is None


def test_walk_of_a_network_already_built(graphs, tmp_path):
    """The export walks the very network it built: building leaves the parsed network as it was."""
    from mbert.export.tensorrt.build import build_parsed, profiles_from

    parsed = parse_onnx(graphs.fp16, "tensorrt-rtx")
    build_parsed(parsed, graphs.fp16, tmp_path / "model.plan", profiles_from(2, 64), compute_capabilities=["8.6"])
    after, _ = walk_parsed(parsed, graphs.plan)
    assert after == walk_precision(graphs.fp16, graphs.plan, family="tensorrt-rtx")
