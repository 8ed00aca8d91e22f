"""Load published ModernBERT checkpoints strictly.

``load_model(source)`` accepts a local folder or a hub id. Hub ids resolve through the local
Hugging Face cache first and download only when that fails and the network allows. Weights are
read from single or sharded safetensors (with the index), else ``pytorch_model.bin`` (with
``weights_only=True``). Loading is a strict copy: every missing, unexpected and mis-shaped tensor
is reported together in one :class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import CheckpointError
from mbert.bundle.files import check_regular, read_json
from mbert.bundle.names import (CONFIG, SPECIAL_TOKENS, ST_CONFIG, ST_MODEL_CONFIG, ST_MODULES, TOKENIZER,
                                TOKENIZER_CONFIG)
from mbert.bundle.paths import inside
from mbert.modeling.model import build_model, encoder_of

# Files a bundle or the runtime may need besides the weights.
SIDE_FILES = (
    CONFIG,
    TOKENIZER,
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS,
    ST_MODULES,
    ST_CONFIG,
    ST_MODEL_CONFIG,
    f"*/{CONFIG}",  # 1_Pooling/config.json and friends
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors")
FALLBACK_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin")

# Tensors that published checkpoints carry and this model deliberately does not use.
KNOWN_UNUSED = (
    re.compile(r"^decoder\.weight$"),  # tied to the token embedding when tie_word_embeddings is true
    re.compile(r"^(model\.)?layers\.\d+\.attn\.rotary_emb\.inv_freq$"),  # recomputed from the thetas
    re.compile(r"^(model\.)?embeddings\.position_ids$"),
)
# Head tensors, unused when a head checkpoint is loaded as a bare encoder (task="encoder").
HEAD_TENSORS = re.compile(r"^(head\.|decoder\.|classifier\.)")


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # local folder holding config.json
    hub_id: str | None = None
    revision: str | None = None


def resolve(source: str | Path, revision: str | None = None, weights: bool = False) -> ResolvedSource:
    """A local folder for ``source``: the folder itself, or the hub snapshot (cache first)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise CheckpointError(f"{path}: folder has no config.json; is it a ModernBERT checkpoint?")
        return ResolvedSource(path.resolve())
    text = str(source)
    if path.exists():
        raise CheckpointError(f"{path}: expected a checkpoint folder, got a file")
    if not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", text) or text.startswith((".", "/")):
        raise CheckpointError(f"{text}: no such folder, and not a valid hub id (owner/name)")
    return _resolve_hub(text, revision, weights)


def _resolve_hub(repo_id: str, revision: str | None, weights: bool) -> ResolvedSource:
    from huggingface_hub import snapshot_download

    patterns = list(SIDE_FILES) + (list(WEIGHT_FILES) + list(FALLBACK_WEIGHT_FILES) if weights else [])
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
        if weights and not _weight_files_present(Path(folder)):
            raise FileNotFoundError("weights not in cache")
    except Exception:  # not (fully) in the cache: try the network
        try:
            folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
        except Exception as exc:  # huggingface_hub raises many types; all mean "could not get it"
            raise CheckpointError(
                f"{repo_id}: not in the local Hugging Face cache and could not be downloaded "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                "pass a local checkpoint folder instead"
            ) from exc
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise CheckpointError(f"{repo_id}: the repository has no {CONFIG}")
    return ResolvedSource(folder, hub_id=repo_id, revision=folder.name if folder.parent.name == "snapshots" else revision)


def _weight_files_present(folder: Path) -> bool:
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    return any((folder / n).is_file() for n in names)


def load_config(source: str | Path) -> ModernBertConfig:
    return ModernBertConfig.from_file(resolve(source).path / CONFIG)


def load_model(
    source: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    task: str | None = None,
    revision: str | None = None,
) -> torch.nn.Module:
    """The eval-mode model for a checkpoint; ``model.config`` is its :class:`ModernBertConfig`.

    ``dtype`` defaults to float32 whatever the checkpoint stores (F16 checkpoints are upcast);
    ``task`` overrides the head ``architectures`` selects (``"encoder"`` loads only the encoder
    of a head checkpoint). ``model.source`` records where it came from.
    """
    resolved = resolve(source, revision=revision, weights=True)
    cfg = ModernBertConfig.from_file(resolved.path / CONFIG)
    if task is not None:
        cfg = cfg.with_task(task)
    with torch.device("meta"):
        model = build_model(cfg)
    state, origin = read_state_dict(resolved.path)
    state = _match_prefix(state, model, drop_heads=task == "encoder")
    _check_keys(state, model, origin)
    model = model.to_empty(device="cpu")
    expected = model.state_dict().keys()
    missing, _ = model.load_state_dict(
        {k: v.to(torch.float32) for k, v in state.items() if k in expected}, strict=False
    )
    assert set(missing) <= {"decoder.weight"}, missing  # only the tied decoder, checked above
    if cfg.tie_word_embeddings and hasattr(model, "decoder"):
        model.decoder.weight = model.model.embeddings.tok_embeddings.weight
    model = model.to(device=device, dtype=dtype or torch.float32).eval()
    encoder_of(model).init_rope()
    model.requires_grad_(False)
    model.source = resolved
    return model


def read_state_dict(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of the checkpoint in ``folder`` and a description of the file(s) they came from."""
    for name, reader, sharded in (("model.safetensors", _read_safetensors, False),
                                  ("model.safetensors.index.json", _read_safetensors, True),
                                  ("pytorch_model.bin", _read_bin, False),
                                  ("pytorch_model.bin.index.json", _read_bin, True)):
        path = folder / name
        if path.is_file():
            return (_read_sharded(path, reader) if sharded else reader(path)), str(path)
    raise CheckpointError(
        f"{folder}: no weights found (looked for model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json)"
    )


def _check_finite(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"{path}: tensor(s) holding NaN or infinite values: {', '.join(sorted(bad)[:10])}")
    return tensors


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: file not found") from exc
    except Exception as exc:  # SafetensorError, OSError, ... for truncated or corrupt files
        raise CheckpointError(f"{path}: not a readable safetensors file, truncated or corrupt ({exc})") from exc
    return _check_finite(tensors, path)


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: file not found") from exc
    except Exception as exc:  # pickle / zip errors for corrupt files, UnpicklingError for unsafe ones
        raise CheckpointError(f"{path}: not a readable PyTorch weights file ({exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a mapping of tensor names to tensors")
    return _check_finite(state, path)


def _read_sharded(index: Path, reader) -> dict[str, torch.Tensor]:
    weight_map = read_json(index, CheckpointError)
    if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
        raise CheckpointError(f"{index}: not a valid shard index (needs a 'weight_map')")
    weight_map = weight_map["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors = reader(inside(index.parent, shard, f"{index}: weight_map", CheckpointError))
        wanted = {k for k, v in weight_map.items() if v == shard}
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise CheckpointError(f"{index.parent / shard}: index lists tensors the shard lacks: {', '.join(missing[:10])}")
        state.update(tensors)
    return state


def _match_prefix(state: dict[str, torch.Tensor], model: torch.nn.Module, drop_heads: bool) -> dict[str, torch.Tensor]:
    """Map checkpoint names onto the model's: ``model.`` prefix added or removed as the head needs."""
    expected_prefixed = any(k.startswith("model.") for k in model.state_dict())
    has_prefix = any(k.startswith("model.") for k in state)
    if expected_prefixed and not has_prefix:
        return {(k if HEAD_TENSORS.match(k) else f"model.{k}"): v for k, v in state.items()}
    if not expected_prefixed and has_prefix:
        out = {}
        for k, v in state.items():
            if k.startswith("model."):
                out[k[len("model."):]] = v
            elif not (drop_heads and HEAD_TENSORS.match(k)):
                out[k] = v
        return out
    return state


def _check_keys(state: dict[str, torch.Tensor], model: torch.nn.Module, origin: str) -> None:
    expected = model.state_dict()
    tied = {"decoder.weight"} if model.config.tie_word_embeddings and hasattr(model, "decoder") else set()
    missing = sorted(k for k in expected if k not in state and k not in tied)
    unexpected = sorted(
        k for k in state if k not in expected and not any(p.match(k) for p in KNOWN_UNUSED)
    )
    misshaped = sorted(
        f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)})"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    )
    not_float = sorted(k for k in expected if k in state and not state[k].is_floating_point())
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {', '.join(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped {len(misshaped)}: {', '.join(misshaped)}")
    if not_float:
        problems.append(f"not floating point: {', '.join(not_float)}")
    if problems:
        raise CheckpointError(f"{origin}: checkpoint does not match the config: " + "; ".join(problems))


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the checkpoint's tokenizer and sentence-transformers files into ``dst`` (the weights travel
    inside the ONNX graphs); returns their relative names. The folders ``modules.json`` names are
    confined to the checkpoint (and so to ``dst``): CheckpointError naming the entry otherwise."""
    import shutil

    names = [n for n in SIDE_FILES if "*" not in n and os.path.lexists(src / n)]
    modules = src / ST_MODULES
    if os.path.lexists(modules):
        entries = read_json(modules, CheckpointError)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise CheckpointError(f"{modules}: expected a list of module objects")
        for i, entry in enumerate(entries):
            sub = entry.get("path") or ""
            if sub:
                rel = f"{sub.rstrip('/')}/{CONFIG}"
                if os.path.lexists(inside(src, rel, f"{modules}: [{i}].path", CheckpointError)):
                    names.append(rel)
    for name in names:
        check_regular(src / name, CheckpointError)
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(src / name, dst / name)  # a new file with the umask's mode, not the source's
        except OSError as exc:  # name the file being written (a full disk is the bundle's, not the source's)
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(dst / name)) from exc
    return names
