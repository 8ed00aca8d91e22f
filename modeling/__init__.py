"""mbert.modeling: the export-ready ModernBERT, its config, checkpoint loader and pooling.

Names are imported on first use, so ``import mbert.modeling.errors`` (every command line's error
handling, Triton's Python models) does not load torch.
"""
from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {
    "ResolvedSource": ".checkpoint", "load_config": ".checkpoint", "load_model": ".checkpoint",
    "resolve": ".checkpoint", "ModernBertConfig": ".config", "ModernBertModel": ".model", "MASK_FILL": ".model",
    "build_model": ".model", "Pooling": ".pooling", "PoolingConfig": ".pooling", "load_pooling": ".pooling",
    **{name: ".errors" for name in (
        "BundleError", "CheckpointError", "ConfigError", "EngineError", "ExportError", "MbertError", "OptionError",
        "PoolingError", "PrecisionError", "TextFileError", "TokenizerError", "ValidationError")},
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
