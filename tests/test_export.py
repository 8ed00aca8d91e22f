"""ONNX export: every config variant validates on real text, dynamic axes, pooling inside the graph,
FP16-safe masks, atomic bundles, and one-line CLI errors."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import SMALL, make_checkpoint, random_batch

from mbert.bundle import FORMAT_VERSION, open_bundle
from mbert.bundle.errors import BundleError
from mbert.bundle.texts import calibration_texts
from mbert.bundle.tokenizer import load_tokenizer
from mbert.bundle.validation import FP32_TOLERANCE, build_cases, compare, default_grid
from mbert.export.onnx.trace import graph_opset, to_onnx
from mbert.export.options import ExportOptions
from mbert.export.pipeline import export_bundle
from mbert.modeling import load_model, load_pooling
from mbert.modeling.graph import GraphModule, eager_runner
from mbert.runtime import pool
from mbert.runtime.backends.onnxruntime import onnx_runner

VARIANTS = {
    "base": ("modernbert-base", "ModernBertModel", dict(SMALL, num_hidden_layers=4)),
    "large-widths": ("modernbert-large", "ModernBertModel", dict(num_hidden_layers=3)),
    "gte-cls": ("gte-modernbert-base", "ModernBertModel", dict(SMALL, num_hidden_layers=3, local_attention=16)),
    "w16-every2-hd32-silu": ("modernbert-base", "ModernBertModel",
                             dict(num_hidden_layers=4, local_attention=16, global_attn_every_n_layers=2, hidden_size=128,
                                  num_attention_heads=4, intermediate_size=192, hidden_activation="silu")),
    "equal-thetas-tanh": ("modernbert-base", "ModernBertModel",
                          dict(SMALL, num_hidden_layers=4, global_rope_theta=10000.0,
                               hidden_activation="gelu_pytorch_tanh")),
    "masked-lm": ("modernbert-base", "ModernBertForMaskedLM", dict(SMALL, num_hidden_layers=3, local_attention=16)),
    "seq-cls-mean": ("modernbert-base", "ModernBertForSequenceClassification",
                     dict(SMALL, num_hidden_layers=3, num_labels=3, classifier_pooling="mean", local_attention=16)),
    "token-cls": ("modernbert-base", "ModernBertForTokenClassification",
                  dict(SMALL, num_hidden_layers=3, num_labels=5, local_attention=16)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_exports_and_validates(tmp_path, name):
    base, arch, overrides = VARIANTS[name]
    layout = "cls-pooling" if name == "gte-cls" else None
    folder = make_checkpoint(tmp_path / "ck", base, arch=arch, seed=21, layout=layout, **overrides)
    model, pooling = load_model(folder), load_pooling(folder)
    io = to_onnx(model, tmp_path / "m.onnx", pooling=pooling, max_seq_len=1024)
    assert graph_opset(tmp_path / "m.onnx") == 18
    graph = GraphModule(model, pooling)
    assert [s.name for s in io] == ["input_ids", "attention_mask", *graph.output_names]
    cfg = model.config
    cases = build_cases(load_tokenizer(folder), calibration_texts(), default_grid(cfg.window_half_width, 1024),
                        cfg.cls_token_id, cfg.sep_token_id, cfg.pad_token_id)
    report = compare("m.onnx", onnx_runner(tmp_path / "m.onnx"), eager_runner(graph), cases,
                     {n: FP32_TOLERANCE for n in graph.output_names})
    report.raise_if_failed()
    assert report.passed and {o.name for o in report.outputs} == set(graph.output_names)
    assert max(o.max_abs_error for o in report.outputs) < 1e-3


@pytest.fixture(scope="module")
def embed_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    folder = make_checkpoint(root / "ck", "gte-modernbert-base", seed=22, layout="mean-normalize",
                             num_hidden_layers=3, **SMALL)
    result = export_bundle(folder, ExportOptions(out=root / "out", max_seq_len=512))
    return folder, result


def test_bundle_contents_and_manifest(embed_bundle):
    folder, result = embed_bundle
    b = result.bundle
    for name in ("model.onnx", "tokenizer.json", "config.json", "modules.json", "1_Pooling/config.json",
                 "sentence_bert_config.json", "manifest.json"):
        assert (b / name).is_file(), name
    m = open_bundle(b).manifest  # verifies every hash and cross-checks the manifest
    assert m.format_version == FORMAT_VERSION and m.max_seq_len == 512
    (graph,) = m.graphs
    assert graph.file == "model.onnx" and graph.opset == 18 and graph.validation.passed
    assert m.source.path == str(folder.resolve())
    assert m.io.output_names == ("last_hidden_state", "sentence_embedding")
    assert m.pooling.modes == ("mean",) and m.pooling.normalize is True
    assert set(m.tool_versions) >= {"torch", "onnx", "onnxruntime", "mbert-export"}
    assert {"triton/README.md", "model.onnx", "tokenizer.json"} <= set(m.files)  # triton/ is sealed too
    assert not list(b.parent.glob(".*partial*"))


def test_unseen_shapes_and_pooling_inside_graph(embed_bundle):
    """Traced at batch 2 x 67; run at 5 x 301 and 1 x 1; sentence_embedding == pooling(last_hidden_state)."""
    folder, result = embed_bundle
    run = onnx_runner(result.bundle / "model.onnx")
    model, pooling = load_model(folder), load_pooling(folder)
    for lengths in ([301, 5, 64, 300, 2], [1]):
        ids, mask = random_batch(lengths, seed=len(lengths))
        out = run(ids.numpy(), mask.numpy())
        with torch.no_grad():
            want = model(ids, mask)
        keep = mask.bool().numpy()
        np.testing.assert_allclose(out["last_hidden_state"][keep], want.numpy()[keep], atol=1e-4, rtol=1e-4)
        pooled = pool(out["last_hidden_state"], mask.numpy(), pooling.modes, pooling.normalize)  # the runtime's
        np.testing.assert_allclose(out["sentence_embedding"], pooled, atol=1e-6, rtol=1e-5)


def test_naive_fp16_conversion_of_padded_batch_has_no_nan(embed_bundle, tmp_path):
    """Finite mask values: even onnxruntime's plain float16 converter gives no NaN on heavy padding."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _, result = embed_bundle
    fp16 = convert_float_to_float16(onnx.load(str(result.bundle / "model.onnx")), keep_io_types=True)
    onnx.save(fp16, str(tmp_path / "naive.onnx"))
    ids, mask = random_batch([500, 3, 1, 129], seed=5)
    out = onnx_runner(tmp_path / "naive.onnx")(ids.numpy(), mask.numpy())
    for name, arr in out.items():
        assert np.isfinite(arr).all(), name


def test_validation_can_fail(embed_bundle, tmp_path):
    """The export's validation catches a graph that differs from the eager model."""
    folder, result = embed_bundle
    model = load_model(folder)
    with torch.no_grad():
        model.layers[1].mlp.Wo.weight.mul_(1.01)  # a 1% error in one matrix
    cfg = model.config
    cases = build_cases(load_tokenizer(folder), calibration_texts()[:4], default_grid(cfg.window_half_width, 256),
                        cfg.cls_token_id, cfg.sep_token_id, cfg.pad_token_id)
    graph = GraphModule(model, load_pooling(folder))
    report = compare("model.onnx", onnx_runner(result.bundle / "model.onnx"), eager_runner(graph), cases,
                     {n: FP32_TOLERANCE for n in graph.output_names})
    assert not report.passed
    with pytest.raises(Exception, match="does not match the eager model"):
        report.raise_if_failed()


def test_interrupted_export_leaves_no_bundle(tmp_path, monkeypatch):
    folder = make_checkpoint(tmp_path / "ck", seed=23, num_hidden_layers=2, **dict(SMALL, local_attention=16))

    def boom(*a, **k):
        raise KeyboardInterrupt  # the user presses Ctrl-C while files are being written

    import mbert.modeling.checkpoint

    monkeypatch.setattr(mbert.modeling.checkpoint, "copy_side_files", boom)
    with pytest.raises(KeyboardInterrupt):
        export_bundle(folder, ExportOptions(out=tmp_path / "out", max_seq_len=128))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no partial folder left either


def test_existing_bundle_needs_overwrite(embed_bundle):
    folder, result = embed_bundle
    with pytest.raises(BundleError, match="already exists; pass --overwrite"):
        export_bundle(folder, ExportOptions(out=result.bundle, max_seq_len=512))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mbert.export.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_cli_corrupt_checkpoint_is_one_line(tmp_path):
    folder = make_checkpoint(tmp_path / "ck", seed=24, num_hidden_layers=2, **dict(SMALL, local_attention=16))
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    proc = _cli(folder, "--out", tmp_path / "out")
    assert proc.returncode == 1
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("[")]
    assert len(lines) == 1 and str(folder / "model.safetensors") in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    debug = _cli(folder, "--out", tmp_path / "out", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_cli_exports_and_prints_summary(tmp_path):
    folder = make_checkpoint(tmp_path / "ck", "gte-modernbert-base", seed=25, layout="cls-pooling",
                             num_hidden_layers=2, **dict(SMALL, local_attention=16))
    proc = _cli(folder, "--out", tmp_path / "out", "--max-seq-len", "256")
    assert proc.returncode == 0, proc.stderr
    assert "[1/4] load" in proc.stderr and "[4/4] write" in proc.stderr
    assert "Bundle written" in proc.stdout and "sentence_embedding" in proc.stdout and "pass" in proc.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["pooling"]["modes"] == ["cls"] and manifest["pooling"]["normalize"] is False
    again = _cli(folder, "--out", tmp_path / "out")
    assert again.returncode == 1 and "--overwrite" in again.stderr


def test_export_help_is_instant_and_imports_nothing_heavy():
    code = ("import sys\nfrom mbert.export.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "heavy = [m for m in ('torch', 'onnxruntime', 'tokenizers', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--random-checkpoint" in done.stdout and "--engine-only" in done.stdout
