"""Which module of the eager model each node of an exported ONNX graph came from.

torch's exporter writes, on every node, the module scopes it was traced under as metadata
(``pkg.torch.onnx.name_scopes``, a Python list literal such as
``['', 'model', 'model.layers.0', 'model.layers.0.attn', 'model.layers.0.attn.Wqkv', 'linear']``).
The deepest scope that names a module of the ModernBERT encoder tells the layer and the site:
``layers.0.attn.Wqkv``. TensorRT's ONNX parser names its layers after the ONNX nodes, so the same
table maps TensorRT layers, and ONNX Runtime's quantizer takes node names to exclude: both the
TensorRT precision walk and the INT8 plan read the graph through :func:`node_scopes`.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
# An encoder module path with the wrapping attribute names stripped: "layers.3.mlp.Wi", "final_norm".
_ENCODER = re.compile(r"(?:^|\.)((?:embeddings|layers\.\d+|final_norm)(?:\.[A-Za-z_]\w*)*)$")
_HEAD = re.compile(r"^(?:model\.)?(head(?:\.\w+)*|decoder|classifier)$")


@dataclass(frozen=True)
class Scope:
    """Where a node sits in the model: ``layer`` (None outside the layers) and the module path
    inside the encoder or head (``layers.2.attn.Wo`` -> layer 2, ``module`` ``attn.Wo``)."""

    layer: int | None
    module: str  # "attn.Wqkv", "mlp", "" (the layer itself: residual adds), "embeddings.norm", "head.dense"

    @property
    def group(self) -> str | None:
        """The precision-plan group of a node inside a layer: residual, attention or mlp."""
        if self.layer is None:
            return None
        if self.module == "attn" or self.module.startswith("attn."):
            return "attention"
        if self.module == "mlp" or self.module.startswith("mlp."):
            return "mlp"
        return "residual"  # the layer's own residual adds and casts, attn_norm, mlp_norm


def scope_of_path(path: str) -> Scope | None:
    """The :class:`Scope` of a module path such as ``model.model.layers.3.mlp.Wi``; None when the path
    is not inside the encoder or a head (the graph wrapper, pooling)."""
    m = _ENCODER.search(path)
    if m:
        inner = m.group(1)
        if inner.startswith("layers."):
            _, index, *rest = inner.split(".")
            return Scope(int(index), ".".join(rest))
        return Scope(None, inner)
    tail = path.split(".", 1)[1] if path.startswith("model.") else path
    h = _HEAD.match(tail)
    return Scope(None, h.group(1)) if h else None


def node_scopes(proto: Any) -> dict[str, Scope]:
    """ONNX node name -> :class:`Scope` for every node of ``proto`` (an ``onnx.ModelProto``) whose
    metadata places it inside the encoder or a head. Nodes without the metadata are left out."""
    table: dict[str, Scope] = {}
    for node in proto.graph.node:
        raw = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
        if raw is None:
            continue
        try:
            scopes = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            continue
        for path in reversed(scopes if isinstance(scopes, list) else []):
            scope = scope_of_path(path) if isinstance(path, str) and "." in path else None
            if scope is not None:
                table[node.name] = scope
                break
    return table
