"""ModernBERT configuration: a frozen dataclass read from a checkpoint's ``config.json``.

Field names are Hugging Face's key names. Both spellings in the wild are read:
the published (transformers 4.x) keys ``global_rope_theta`` / ``local_rope_theta`` /
``global_attn_every_n_layers``, and the transformers-5 forms ``rope_parameters`` /
``layer_types``. Derived values are properties; nothing is mutated after construction.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mbert.bundle.errors import ConfigError
from mbert.bundle.files import read_json

# Every ``hidden_activation`` transformers' ACT2FN accepts that makes sense for a GeGLU gate.
ACTIVATIONS = (
    "gelu",  # exact erf GELU (the published checkpoints)
    "gelu_new",
    "gelu_fast",
    "gelu_pytorch_tanh",
    "gelu_accurate",
    "quick_gelu",
    "silu",
    "swish",
    "relu",
    "gelu_python",
    "mish",
    "tanh",
    "sigmoid",
)

TASKS = ("encoder", "masked-lm", "sequence-classification", "token-classification")
_ARCHITECTURE_TASKS = {
    "ModernBertModel": "encoder",
    "ModernBertForMaskedLM": "masked-lm",
    "ModernBertForSequenceClassification": "sequence-classification",
    "ModernBertForTokenClassification": "token-classification",
}


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 8192
    hidden_activation: str = "gelu"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_attention: int = 128
    layer_types: tuple[str, ...] = ()
    pad_token_id: int = 50283
    bos_token_id: int | None = 50281
    eos_token_id: int | None = 50282
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    # heads (used only by the head an ``architectures`` entry selects)
    architectures: tuple[str, ...] = ("ModernBertModel",)
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False
    decoder_bias: bool = True
    tie_word_embeddings: bool = True
    id2label: dict[int, str] = field(default_factory=dict)
    torch_dtype: str | None = None
    source: str = "<memory>"  # the file this was read from, for error messages

    # ---------------------------------------------------------------- derived values
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def window_half_width(self) -> int:
        """Key j is visible to query i in a local layer when |i - j| <= this (64 for 128)."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def rope_theta(self, layer: int) -> float:
        return self.global_rope_theta if self.is_global(layer) else self.local_rope_theta

    @property
    def task(self) -> str:
        return _ARCHITECTURE_TASKS[self.architectures[0]]

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_file(cls, path: str | Path) -> "ModernBertConfig":
        path = Path(path)
        raw = read_json(path, ConfigError)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "ModernBertConfig":
        r = _Reader(raw, source)
        model_type = raw.get("model_type", "modernbert")
        if model_type != "modernbert":
            raise ConfigError(f"{source}: key 'model_type' is {model_type!r}; only 'modernbert' is supported")

        hidden = r.int("hidden_size")
        heads = r.int("num_attention_heads")
        layers = r.int("num_hidden_layers")
        if hidden % heads:
            raise ConfigError(
                f"{source}: key 'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' ({heads})"
            )
        if (hidden // heads) % 2:
            raise ConfigError(f"{source}: head dim {hidden // heads} is odd; rotary embeddings need an even one")

        every_n = r.int("global_attn_every_n_layers", default=3)
        layer_types = raw.get("layer_types")
        if layer_types is None:
            layer_types = [
                "full_attention" if i % every_n == 0 else "sliding_attention" for i in range(layers)
            ]
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != layers
            or any(t not in ("full_attention", "sliding_attention") for t in layer_types)
        ):
            raise ConfigError(
                f"{source}: key 'layer_types' must list {layers} entries of "
                "'full_attention'/'sliding_attention'"
            )

        global_theta, local_theta = _rope_thetas(raw, r, source)

        act = r.str("hidden_activation", default=raw.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            raise ConfigError(f"{source}: key 'hidden_activation' is {act!r}; supported: {', '.join(ACTIVATIONS)}")
        cls_act = r.str("classifier_activation", default="gelu")
        if cls_act not in ACTIVATIONS:
            raise ConfigError(
                f"{source}: key 'classifier_activation' is {cls_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )

        archs = raw.get("architectures") or ["ModernBertModel"]
        if not isinstance(archs, list) or archs[0] not in _ARCHITECTURE_TASKS:
            raise ConfigError(
                f"{source}: key 'architectures' is {archs!r}; supported: {', '.join(_ARCHITECTURE_TASKS)}"
            )
        pooling = r.str("classifier_pooling", default="cls")
        if pooling not in ("cls", "mean"):
            raise ConfigError(f"{source}: key 'classifier_pooling' is {pooling!r}; expected 'cls' or 'mean'")

        id2label = raw.get("id2label") or {}
        try:
            id2label = {int(k): str(v) for k, v in id2label.items()}
        except (AttributeError, ValueError) as exc:
            raise ConfigError(f"{source}: key 'id2label' must map integer ids to names") from exc
        if not id2label and archs[0] != "ModernBertModel" and archs[0] != "ModernBertForMaskedLM":
            n = r.int("num_labels", default=2)
            id2label = {i: f"LABEL_{i}" for i in range(n)}

        eps = raw.get("norm_eps", raw.get("layer_norm_eps", 1e-5))
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise ConfigError(f"{source}: key 'norm_eps' must be a small positive number, got {eps!r}")

        local = r.int("local_attention", default=128)
        if local < 2:
            raise ConfigError(f"{source}: key 'local_attention' must be >= 2, got {local}")

        return cls(
            vocab_size=r.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.int("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=r.int("max_position_embeddings", default=8192),
            hidden_activation=act,
            norm_eps=float(eps),
            norm_bias=r.bool("norm_bias", default=False),
            attention_bias=r.bool("attention_bias", default=False),
            mlp_bias=r.bool("mlp_bias", default=False),
            global_rope_theta=global_theta,
            local_rope_theta=local_theta,
            local_attention=local,
            layer_types=tuple(layer_types),
            pad_token_id=r.int("pad_token_id", default=50283),
            bos_token_id=r.opt_int("bos_token_id", 50281),
            eos_token_id=r.opt_int("eos_token_id", 50282),
            cls_token_id=r.opt_int("cls_token_id", 50281),
            sep_token_id=r.opt_int("sep_token_id", 50282),
            architectures=tuple(archs),
            classifier_pooling=pooling,
            classifier_activation=cls_act,
            classifier_bias=r.bool("classifier_bias", default=False),
            decoder_bias=r.bool("decoder_bias", default=True),
            tie_word_embeddings=r.bool("tie_word_embeddings", default=True),
            id2label=id2label,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            source=source,
        )

    def with_task(self, task: str) -> "ModernBertConfig":
        """The same config with the head chosen by ``task`` instead of ``architectures``."""
        if task not in TASKS:
            raise ConfigError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
        arch = {v: k for k, v in _ARCHITECTURE_TASKS.items()}[task]
        return ModernBertConfig(**{**asdict(self), "architectures": (arch,)})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["architectures"] = list(self.architectures)
        d.pop("source")
        return d


def _rope_thetas(raw: dict[str, Any], r: "_Reader", source: str) -> tuple[float, float]:
    params = raw.get("rope_parameters")
    if params is not None:
        try:
            g = float(params["full_attention"]["rope_theta"])
            s = float(params["sliding_attention"]["rope_theta"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{source}: key 'rope_parameters' needs full_attention.rope_theta and "
                "sliding_attention.rope_theta"
            ) from exc
        for kind in ("full_attention", "sliding_attention"):
            rope_type = params[kind].get("rope_type", "default")
            if rope_type != "default":
                raise ConfigError(
                    f"{source}: key 'rope_parameters.{kind}.rope_type' is {rope_type!r}; only 'default' is supported"
                )
    else:
        if raw.get("rope_scaling"):
            raise ConfigError(f"{source}: key 'rope_scaling' is set; scaled RoPE is not supported")
        g = r.float("global_rope_theta", default=160_000.0)
        s = r.float("local_rope_theta", default=10_000.0)
    for name, value in (("global_rope_theta", g), ("local_rope_theta", s)):
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{source}: key {name!r} must be a positive number, got {value!r}")
    return g, s


class _Reader:
    """Typed access to a raw config dict; every failure names the key and the file."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    _MISSING = object()

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is self._MISSING:
            raise ConfigError(f"{self.source}: required key {key!r} is missing")
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{self.source}: key {key!r} must be a non-negative integer, got {value!r}")
        if value == 0 and key not in ("pad_token_id",):
            raise ConfigError(f"{self.source}: key {key!r} must be positive, got 0")
        return value

    def opt_int(self, key: str, default: int | None) -> int | None:
        value = self.raw.get(key, default)
        if isinstance(value, list):  # eos_token_id may be a list
            value = value[0] if value else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{self.source}: key {key!r} must be an integer or null, got {value!r}")
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.source}: key {key!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: key {key!r} must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.source}: key {key!r} must be a string, got {value!r}")
        return value
