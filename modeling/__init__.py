"""mbert.modeling: the export-ready ModernBERT in PyTorch, its strict checkpoint loader, the pooling
module, and random-weight checkpoints. It builds on :mod:`mbert.bundle`, the torch-free contract
(config, pooling declaration, output contract, errors).

Names are imported on first use, so importing the package does not load torch.
"""
from __future__ import annotations

from mbert.bundle.lazy import lazy_exports

_EXPORTS = {
    "ResolvedSource": ".checkpoint", "load_config": ".checkpoint", "load_model": ".checkpoint",
    "resolve": ".checkpoint", "ModernBertModel": ".model", "build_model": ".model", "Pooling": ".pooling",
    "load_pooling": ".pooling", "GraphModule": ".graph", "eager_runner": ".graph",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
