"""mbert.modeling: the export-ready ModernBERT, its config, checkpoint loader and pooling."""
from .checkpoint import ResolvedSource, load_config, load_model, resolve
from .config import ModernBertConfig
from .errors import (
    BundleError,
    CheckpointError,
    ConfigError,
    EngineError,
    ExportError,
    MbertError,
    PoolingError,
    PrecisionError,
    TextFileError,
    TokenizerError,
    ValidationError,
)
from .model import MASK_FILL, ModernBertModel, build_model
from .pooling import Pooling, PoolingConfig, load_pooling

__all__ = [
    "BundleError", "CheckpointError", "ConfigError", "EngineError", "ExportError", "MbertError",
    "PoolingError", "PrecisionError", "TextFileError", "TokenizerError", "ValidationError",
    "ModernBertConfig", "ModernBertModel", "MASK_FILL", "Pooling", "PoolingConfig", "ResolvedSource",
    "build_model", "load_config", "load_model", "load_pooling", "resolve",
]
