"""mbert.export.onnx.scopes: ONNX node -> (layer, module) from the exporter's name-scope metadata."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mbert.export.onnx.scopes import NAME_SCOPES, Scope, node_scopes, scope_of_path


@pytest.mark.parametrize("path, want, group", [
    ("model.layers.0.attn.Wqkv", Scope(0, "attn.Wqkv"), "attention"),
    ("model.model.layers.12.mlp.Wo", Scope(12, "mlp.Wo"), "mlp"),
    ("model.layers.3.attn_norm", Scope(3, "attn_norm"), "residual"),
    ("model.layers.3", Scope(3, ""), "residual"),
    ("model.embeddings.norm", Scope(None, "embeddings.norm"), None),
    ("model.final_norm", Scope(None, "final_norm"), None),
    ("model.head.dense", Scope(None, "head.dense"), None),
    ("model.classifier", Scope(None, "classifier"), None),
])
def test_scope_of_path(path, want, group):
    assert scope_of_path(path) == want and want.group == group


@pytest.mark.parametrize("path", ["model", "pooling", "model.layersX.1", ""])
def test_paths_outside_the_model_have_no_scope(path):
    assert scope_of_path(path) is None


def _node(name, scopes):
    return SimpleNamespace(name=name, metadata_props=[SimpleNamespace(key=NAME_SCOPES, value=repr(scopes))])


def test_node_scopes_takes_the_deepest_module():
    proto = SimpleNamespace(graph=SimpleNamespace(node=[
        _node("node_linear", ["", "model", "model.layers.0", "model.layers.0.attn", "model.layers.0.attn.Wqkv", "linear"]),
        _node("node_add", ["", "model", "model.layers.1", "add_9"]),
        _node("node_wrapper", ["", "model", "add_35"]),
        SimpleNamespace(name="no_metadata", metadata_props=[]),
    ]))
    assert node_scopes(proto) == {"node_linear": Scope(0, "attn.Wqkv"), "node_add": Scope(1, "")}
