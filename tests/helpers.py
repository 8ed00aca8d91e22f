"""Test checkpoints: real transformers models with informative random weights, saved to disk.

transformers' default init (std 0.02) leaves each layer's contribution tiny next to the
embedding, so wrong windows, thetas or activations hide behind cosines of 0.99999. Here every
matrix is redrawn with std 1/sqrt(fan_in) and every norm weight is perturbed, so each layer
matters (``test_pitfalls.py`` proves the comparisons then fail on each known porting mistake).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
TEXTS = [
    "It's time for tea.",
    "The quick brown fox jumps over the lazy dog.",
    "search_query: how do rotary position embeddings work?",
    "def add(a, b):\n    return a + b\n",
]


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def informative_init_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every weight so that every layer matters (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g))
            else:
                continue
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


def make_checkpoint(
    out: Path,
    base: str = "modernbert-base",
    *,
    arch: str = "ModernBertModel",
    seed: int = 0,
    save_dtype: torch.dtype = torch.float32,
    shard_size: str | None = None,
    tokenizer: bool = True,
    layout: str | None = None,
    scale_layer_mlp: tuple[int, float] | None = None,
    outlier_channel: tuple[int, int, float] | None = None,
    **overrides,
) -> Path:
    """Build a seeded random transformers ModernBERT, save it with ``save_pretrained``, return the folder.

    ``overrides`` replace config keys (e.g. ``num_hidden_layers=3``); ``layout`` copies a
    sentence-transformers layout from the fixtures; ``scale_layer_mlp=(i, s)`` multiplies layer
    i's MLP output matrix by s (to build a checkpoint whose residual stream overflows FP16);
    ``outlier_channel=(i, c, s)`` gives layer i's ``mlp.Wi`` input an activation outlier channel: the
    ``mlp_norm`` weight of channel c times s and ``Wi``'s column c divided by s, so the FP32 function is
    unchanged while a per-tensor INT8 activation scale is stretched s-fold (the GeGLU-input outliers
    of real checkpoints).
    """
    import transformers

    raw = fixture_config(base)
    raw.update(overrides)
    raw["architectures"] = [arch]
    for key in ("_name_or_path", "transformers_version", "torch_dtype"):
        raw.pop(key, None)
    cfg = transformers.ModernBertConfig(**raw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    informative_init_(model, seed)
    if scale_layer_mlp is not None:
        layer, scale = scale_layer_mlp
        encoder = model if arch == "ModernBertModel" else model.model
        with torch.no_grad():
            encoder.layers[layer].mlp.Wo.weight.mul_(scale)
    if outlier_channel is not None:
        layer, channel, scale = outlier_channel
        encoder = model if arch == "ModernBertModel" else model.model
        with torch.no_grad():
            encoder.layers[layer].mlp_norm.weight[channel] *= scale
            encoder.layers[layer].mlp.Wi.weight[:, channel] /= scale
    model = model.to(save_dtype)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    if tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(FIXTURES / "modernbert-base" / f, out / f)
    if layout:
        src = FIXTURES / "sentence-transformers" / layout
        for f in src.rglob("*"):
            if f.is_file():
                (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, out / f.relative_to(src))
        pool_cfg = out / "1_Pooling" / "config.json"
        pc = json.loads(pool_cfg.read_text())
        pc["word_embedding_dimension"] = raw["hidden_size"]
        pool_cfg.write_text(json.dumps(pc, indent=2))
        if "Normalize" in (out / "modules.json").read_text():
            (out / "2_Normalize").mkdir(exist_ok=True)
    return out


def hf_reference(folder: Path, arch: str = "ModernBertModel"):
    import transformers

    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def tokenize(folder: Path, texts: list[str], max_length: int | None = None):
    """Right-padded int64 ids and mask with the real tokenizer in ``folder``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if max_length:
        tok.enable_truncation(max_length)
    tok.enable_padding(pad_id=50283, pad_token="[PAD]")
    enc = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in enc], dtype=torch.int64)
    mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.int64)
    return ids, mask


def random_batch(lengths: list[int], vocab: int = 50368, seed: int = 0):
    """Right-padded random ids (avoiding special ids) for the given lengths."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), 50283, dtype=torch.int64)
    mask = torch.zeros((len(lengths), T), dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, 50000, (n,), generator=g)
        ids[i, 0] = 50281
        mask[i, :n] = 1
    return ids, mask
