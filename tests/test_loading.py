"""Loader strictness, clear errors, tokenizers and sentence-transformers pooling."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import FIXTURES, make_checkpoint, tokenize

from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import CheckpointError, ConfigError, PoolingError
from mbert.modeling import Pooling, load_model, load_pooling


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("small"), seed=11, num_hidden_layers=4, local_attention=16,
                           hidden_size=128, num_attention_heads=2, intermediate_size=192)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(small, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(small, tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    del state["layers.3.mlp.Wo.weight"]
    state["layers.9.extra.weight"] = torch.zeros(2)
    state["final_norm.weight"] = torch.zeros(7)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(folder)
    msg = str(err.value)
    assert str(folder / "model.safetensors") in msg
    assert "layers.3.mlp.Wo.weight" in msg and "layers.9.extra.weight" in msg  # all reported together
    assert "final_norm.weight (checkpoint (7,), model (128,))" in msg


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_named(small, tmp_path, damage):
    folder = _copy(small, tmp_path / damage)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_model(folder)


def test_unknown_activation_and_missing_key(tmp_path):
    raw = json.loads((FIXTURES / "modernbert-base" / "config.json").read_text())
    bad = dict(raw, hidden_activation="gelu_99")
    (tmp_path / "a.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"a\.json: key 'hidden_activation' is 'gelu_99'"):
        ModernBertConfig.from_file(tmp_path / "a.json")
    del raw["hidden_size"]
    (tmp_path / "b.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"b\.json: required key 'hidden_size' is missing"):
        ModernBertConfig.from_file(tmp_path / "b.json")
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"c\.json: not valid JSON"):
        ModernBertConfig.from_file(tmp_path / "c.json")


def test_published_configs_read_exactly():
    base = ModernBertConfig.from_file(FIXTURES / "modernbert-base" / "config.json")
    assert (base.hidden_size, base.num_hidden_layers, base.num_attention_heads, base.intermediate_size) == (768, 22, 12, 1152)
    assert (base.global_rope_theta, base.local_rope_theta, base.window_half_width) == (160000.0, 10000.0, 64)
    assert [i for i in range(22) if base.is_global(i)] == [0, 3, 6, 9, 12, 15, 18, 21]
    assert base.task == "masked-lm" and base.hidden_activation == "gelu"
    large = ModernBertConfig.from_file(FIXTURES / "modernbert-large" / "config.json")
    assert (large.hidden_size, large.num_hidden_layers, large.head_dim) == (1024, 28, 64)
    gte = ModernBertConfig.from_file(FIXTURES / "gte-modernbert-base" / "config.json")
    assert gte.task == "encoder" and gte.torch_dtype == "float16"


def test_bias_flags_are_honoured(tmp_path):
    folder = make_checkpoint(tmp_path / "b", seed=12, num_hidden_layers=2, local_attention=16, hidden_size=64,
                             num_attention_heads=2, intermediate_size=96, attention_bias=True, mlp_bias=True)
    model = load_model(folder)
    assert model.layers[1].attn.Wqkv.bias is not None and model.layers[1].mlp.Wi.bias is not None
    cfg = json.loads((folder / "config.json").read_text())
    cfg["attention_bias"] = False  # the checkpoint now has biases the config does not declare
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unexpected .*layers.0.attn.Wqkv.bias"):
        load_model(folder)


def test_unreachable_hub_id_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="no-such-org/no-such-model: not in the local Hugging Face cache"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(CheckpointError, match="no such folder"):
        load_model("./does/not/exist")


@pytest.mark.parametrize("name", ["modernbert-base", "gte-modernbert-base"])
def test_real_tokenizers(name):
    ids, _ = tokenize(FIXTURES / name, ["It's time for tea."])
    assert ids[0].tolist() == [50281, 1147, 434, 673, 323, 10331, 15, 50282]
    ids, _ = tokenize(FIXTURES / name, ["The quick brown fox jumps over the lazy dog."])
    assert ids.shape[1] == 12


@pytest.mark.parametrize("layout,mode,normalize", [("cls-pooling", ("cls",), False), ("mean-normalize", ("mean",), True)])
def test_pooling_matches_sentence_transformers(tmp_path, layout, mode, normalize):
    from sentence_transformers import SentenceTransformer

    folder = make_checkpoint(tmp_path / layout, "gte-modernbert-base", seed=13, num_hidden_layers=4, layout=layout)
    pooling = load_pooling(folder)
    assert pooling.modes == mode and pooling.normalize is normalize
    texts = ["It's time for tea.", "Padding forces this batch to differ in length " * 20, "short", "x " * 600]
    st = SentenceTransformer(str(folder), device="cpu")
    st.max_seq_length = 512
    expected = st.encode(texts, convert_to_numpy=True, batch_size=3)
    model = load_model(folder)
    ids, mask = tokenize(folder, texts, max_length=512)
    with torch.no_grad():
        got = Pooling.of(pooling)(model(ids, mask), mask).numpy()
    cos = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.min() >= 0.99999, cos
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    if not normalize:  # gte-style: vectors are not unit length, and we do not pretend they are
        assert np.linalg.norm(got, axis=-1).min() > 2


def test_pooling_modes_and_errors(tmp_path):
    from mbert.modeling.pooling import Pooling

    h = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(Pooling(("cls",), False)(h, mask), h[:, 0])
    torch.testing.assert_close(Pooling(("mean",), False)(h, mask)[0], h[0, :3].mean(0))
    torch.testing.assert_close(Pooling(("max",), False)(h, mask)[0], h[0, :3].amax(0))
    torch.testing.assert_close(Pooling(("lasttoken",), False)(h, mask)[0], h[0, 2])
    torch.testing.assert_close(Pooling(("mean_sqrt_len_tokens",), False)(h, mask)[0], h[0, :3].sum(0) / 3**0.5)
    w = torch.tensor([1.0, 2.0, 3.0])[:, None]
    torch.testing.assert_close(Pooling(("weightedmean",), False)(h, mask)[0], (h[0, :3] * w).sum(0) / 6)
    assert torch.allclose(Pooling(("cls", "mean"), True)(h, mask).norm(dim=-1), torch.ones(2))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PoolingError, match=r"Dense \(2_Dense\)"):
        load_pooling(tmp_path)


def test_hub_id_resolves_from_local_cache_offline(small, tmp_path):
    """A hub id loads from the Hugging Face cache with no network (HF_HUB_OFFLINE=1)."""
    import os
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--tiny-modernbert"
    shutil.copytree(small, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    code = ("from mbert.modeling import load_model; m = load_model('some-org/tiny-modernbert'); "
            "print(m.source.hub_id, m.source.revision, m.config.num_hidden_layers)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["some-org/tiny-modernbert", commit, "4"]
