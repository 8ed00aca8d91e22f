"""Test checkpoints: real transformers models with informative random weights, saved to disk.

transformers' default init (std 0.02) leaves each layer's contribution tiny next to the
embedding, so wrong windows, thetas or activations hide behind cosines of 0.99999. Here every
matrix is redrawn with std 1/sqrt(fan_in) and every norm weight is perturbed, so each layer
matters (``tests/test_modeling.py::test_parity_check_catches_pitfall`` proves the comparisons
then fail on each known porting mistake). ``SMALL`` is the one size preset of the small models.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mbert.modeling.random import informative_init_

FIXTURES = Path(__file__).parent / "fixtures"
# The one size preset of the small test models (layers and window vary per test).
SMALL = dict(hidden_size=128, num_attention_heads=2, intermediate_size=192, local_attention=32)
TEXTS = [
    "It's time for tea.",
    "The quick brown fox jumps over the lazy dog.",
    "search_query: how do rotary position embeddings work?",
    "def add(a, b):\n    return a + b\n",
]


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


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


# --- the runtime tests' bundles ------------------------------------------------------------------

MAX_LEN = 128  # bundles are exported at 128 tokens, so ordinary text is truncated and padded
OUTLIER = (1, 5, 50.0)  # checkpoint("outlier"): layer 1's mlp.Wi input channel 5 fifty times the others
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
RUNTIME_TEXTS = [
    "It's time for tea.",
    "The quick brown fox jumps over the lazy dog.",
    "how do rotary position embeddings work?",
    "def add(a, b):\n    return a + b\n",
    "A short one.",
    "x",
    " ".join(["Sliding-window attention lets every token see its neighbours within a fixed band, while "
              "every third layer attends globally across the whole sequence."] * 12),  # > 128 tokens
    "Les modèles d'encodage produisent des vecteurs; 多语言文本 también funciona. " * 3,
    " ".join(f"item {i}: value {i * i}" for i in range(60)),  # > 128 tokens
    "What is the capital of France?",
]


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


class Bundles:
    """Checkpoints and bundles built on first use under ``root`` (SMALL, 3 layers; 1 for heads), each
    exported once with the real pipeline at ``MAX_LEN`` tokens."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict[str, Path] = {}

    def checkpoint(self, kind: str) -> Path:
        key = f"ck-{kind}"
        if key not in self._made:
            self._made[key] = self._checkpoint(kind, self.root / key)
        return self._made[key]

    def bundle(self, kind: str) -> Path:
        """The FP32 bundle of checkpoint(kind); kind "mean-fp16" is the same checkpoint with --fp16."""
        if kind not in self._made:
            from mbert.export.options import ExportOptions
            from mbert.export.pipeline import export_bundle

            fp16 = kind.endswith("-fp16")
            out = self.root / f"bundle-{kind}"
            export_bundle(self.checkpoint(kind.removesuffix("-fp16")),
                          ExportOptions(out=out, max_seq_len=MAX_LEN, fp16=fp16, engine="none"))
            self._made[kind] = out
        return self._made[kind]

    def int8(self) -> tuple[Path, str]:
        """The ``--int8`` bundle of checkpoint("outlier"), exported through the ``mbert-export`` command
        line (click's CliRunner, in process), and what the command printed."""
        if "int8" not in self._made:
            from click.testing import CliRunner

            from mbert.export.cli import main

            out = self.root / "bundle-outlier-int8"
            result = CliRunner().invoke(main, [str(self.checkpoint("outlier")), "--int8", "--out", str(out),
                                               "--max-seq-len", str(MAX_LEN)])
            assert result.exit_code == 0, result.output
            self._made["int8"], self._int8_output = out, result.stdout
        return self._made["int8"], self._int8_output

    def copy(self, kind: str, dest: Path) -> Path:
        """A private copy of bundle(kind) to tamper with."""
        shutil.copytree(self.bundle(kind), dest)
        return dest

    def sentence_transformer(self, kind: str):
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self.checkpoint(kind)), device="cpu")
        model.max_seq_length = MAX_LEN
        return model

    @staticmethod
    def _checkpoint(kind: str, folder: Path) -> Path:
        layers = dict(SMALL, num_hidden_layers=3)
        head = dict(SMALL, num_hidden_layers=1)  # heads need no local layers (the encoder bundles cover them)
        labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
        if kind == "cls":  # CLS pooling, no Normalize; prompts kept in pooling
            make_checkpoint(folder, base="gte-modernbert-base", layout="cls-pooling", seed=1, **layers)
            write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": None})
        elif kind == "mean":  # mean + Normalize; prompts excluded from pooling
            make_checkpoint(folder, base="gte-modernbert-base", layout="mean-normalize", seed=2, **layers)
            write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": None})
            write_json(folder / "sentence_bert_config.json", {"max_seq_length": MAX_LEN, "do_lower_case": False})
            pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
            write_json(folder / "1_Pooling" / "config.json", dict(pool, include_prompt=False))
        elif kind == "outlier":  # mean + Normalize; layer 1's mlp.Wi input has an activation outlier channel
            make_checkpoint(folder, base="gte-modernbert-base", layout="mean-normalize", seed=3,
                            outlier_channel=OUTLIER, **layers)
        elif kind == "seqcls":
            make_checkpoint(folder, arch="ModernBertForSequenceClassification", seed=3, classifier_pooling="mean",
                            **labels, **head)
        elif kind == "tokcls":
            make_checkpoint(folder, arch="ModernBertForTokenClassification", seed=4, **labels, **head)
        elif kind == "mlm":
            make_checkpoint(folder, arch="ModernBertForMaskedLM", seed=5, **head)
        else:
            raise KeyError(kind)
        return folder


def edit_manifest(folder: Path, edit, reseal: bool = True) -> None:
    """Edit a bundle's manifest.json as JSON. ``reseal`` recomputes its seal afterwards, as a careful
    hand-edit would, so that the checks behind the seal (types, paths, cross-checks) must catch it."""
    from mbert.bundle.manifest import manifest_digest

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    if reseal:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def cosines(a, b):
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def torch_blocker(folder: Path) -> dict[str, str]:
    """An environment whose Pythons cannot import torch (``sys.modules["torch"] = None`` in a
    ``sitecustomize`` on PYTHONPATH, inherited by every child Python): what a serving install without
    the exporter's extra looks like to the code."""
    (folder / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


TINY = dict(SMALL, num_hidden_layers=2, local_attention=16)  # the export tests' checkpoint: seconds to export


def export_cli(*args, cwd=None, timeout=600):
    """``mbert-export ARGS`` as a user runs it (a child Python), output captured."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mbert.export.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def tiny_checkpoint(tmp_path_factory, name: str, seed: int) -> Path:
    """A TINY gte-modernbert-base-shaped checkpoint with CLS pooling (the export tests' input)."""
    return make_checkpoint(tmp_path_factory.mktemp(name) / "ck", "gte-modernbert-base", seed=seed,
                           layout="cls-pooling", **TINY)


def tiny_bundle(ck: Path, tmp_path_factory, name: str, *args) -> Path:
    """``ck`` exported at 64 tokens (plus ``args``) by the command line; the export must succeed."""
    out = tmp_path_factory.mktemp(name) / "b"
    proc = export_cli(ck, "--out", out, "--max-seq-len", "64", *args)
    assert proc.returncode == 0, proc.stderr
    return out


def error_line(proc) -> str:
    """The one ``error:`` line a failed command printed (and no traceback)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "internal error:"))]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its relative path and SHA-256."""
    import hashlib

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
