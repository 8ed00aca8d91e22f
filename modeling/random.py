"""Random-weight ModernBERT checkpoints, for trying the tool offline and for smoke tests.

``write_random_checkpoint(folder, preset)`` writes a complete sentence-transformers checkpoint:
the published answerdotai/ModernBERT-base config (``preset="base"``, 149M parameters) or the same
architecture narrowed and shortened (``preset="tiny"``), the real ModernBERT tokenizer that ships
with this package, mean pooling + Normalize, and **random** weights drawn so that every layer
matters (:func:`informative_init_`). Its config.json carries ``"mbert_random_weights": true`` and
the folder a README saying so: the vectors it produces mean nothing.
"""
from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import torch
from torch import nn

from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import CheckpointError
from mbert.bundle.names import CONFIG, SPECIAL_TOKENS, ST_MODULES, TOKENIZER, TOKENIZER_CONFIG
from mbert.modeling.model import LayerNorm, build_model

RANDOM_KEY = "mbert_random_weights"
PRESETS = {
    "base": {},  # the published ModernBERT-base shapes
    "tiny": dict(hidden_size=128, num_attention_heads=2, intermediate_size=192, num_hidden_layers=4,
                 local_attention=32),
}
_README = """# RANDOM WEIGHTS: not a trained model

Written by `mbert-export --random-checkpoint` ({preset} preset, seed {seed}) to try mbert-export
without downloading a model. The architecture, tokenizer and pooling are ModernBERT's; the weights
are random numbers, so the embeddings it produces mean nothing.
"""


def informative_init_(model: nn.Module, seed: int) -> None:
    """Redraw every weight so that every layer matters: matrices with std 1/sqrt(fan_in), embeddings
    N(0, 1), norm weights 1 + N(0, 0.2), biases N(0, 0.1). (transformers' default init, std 0.02, leaves
    each layer's contribution tiny next to the embedding, hiding wrong windows or thetas behind cosines
    of 0.99999.) Works on this package's model and on transformers' ModernBERT alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, nn.Linear):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
            elif isinstance(module, (nn.LayerNorm, LayerNorm)):
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g))
            else:
                continue
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


def write_random_checkpoint(folder: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight encoder checkpoint (see the module docstring) into ``folder``."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise CheckpointError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise CheckpointError(f"{folder}: exists and is not an empty folder; choose a new folder")
    data = files("mbert.modeling") / "data" / "modernbert-base"
    raw = json.loads((data / CONFIG).read_text(encoding="utf-8"))
    raw.update(PRESETS[preset], architectures=["ModernBertModel"], torch_dtype="float32", **{RANDOM_KEY: True})
    raw.pop("_name_or_path", None)
    cfg = ModernBertConfig.from_dict(raw, source="random checkpoint")
    torch.manual_seed(seed)
    model = build_model(cfg)
    informative_init_(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", RANDOM_KEY: "true"})
    (folder / CONFIG).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for name in (TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS):
        (folder / name).write_bytes((data / name).read_bytes())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / ST_MODULES).write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / CONFIG).write_text(json.dumps(
        {"word_embedding_dimension": cfg.hidden_size, "pooling_mode_mean_tokens": True, "include_prompt": True},
        indent=2) + "\n", encoding="utf-8")
    (folder / "2_Normalize").mkdir()
    (folder / "README.md").write_text(_README.format(preset=preset, seed=seed), encoding="utf-8")
    return folder


def is_random(folder: str | Path) -> bool:
    """True for a checkpoint written by :func:`write_random_checkpoint`."""
    try:
        return json.loads((Path(folder) / CONFIG).read_text(encoding="utf-8")).get(RANDOM_KEY) is True
    except (OSError, ValueError, AttributeError):
        return False
