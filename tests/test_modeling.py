"""The eager model and loader match transformers exactly, and the comparison can fail."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_reference, make_checkpoint, random_batch, tokenize

from mbert.modeling import load_model
from mbert.modeling.model import LayerNorm

# fp32 parity tolerance: both sides run the same fp32 arithmetic in a different order
# (blocked vs masked attention, pre-scaled Q); measured differences are ~1e-6.
ATOL, RTOL = 1e-5, 1e-4


def assert_parity(ours, ref, ids, mask, head: bool = False):
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask)
        expected = out.logits if head else out.last_hidden_state
        got = ours(ids, mask)
    if expected.ndim == 3:  # padded positions are not defined by the reference's contract
        keep = mask.bool()
        expected, got = expected[keep], got[keep]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


VARIANTS = {
    # name: (fixture config, overrides)
    "base-w128-every3": ("modernbert-base", dict(num_hidden_layers=4)),
    "large-w128": ("modernbert-large", dict(num_hidden_layers=3)),
    "gte-w128": ("gte-modernbert-base", dict(num_hidden_layers=4)),
    "w16-every2-hd32-silu": (
        "modernbert-base",
        dict(num_hidden_layers=4, local_attention=16, global_attn_every_n_layers=2, hidden_size=256,
             num_attention_heads=8, intermediate_size=384, hidden_activation="silu"),
    ),
    "w16-equal-thetas-tanh": (
        "modernbert-base",
        dict(num_hidden_layers=5, local_attention=16, global_rope_theta=10000.0, local_rope_theta=10000.0,
             hidden_size=256, num_attention_heads=4, intermediate_size=384, hidden_activation="gelu_pytorch_tanh"),
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    base, overrides = VARIANTS[request.param]
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), base, seed=1, **overrides)
    return folder, load_model(folder), hf_reference(folder)


@pytest.mark.parametrize(
    "lengths",
    [[1], [7], [16], [64], [129], [130], [300, 31, 5], [257, 256, 1]],
    ids=lambda x: "x".join(map(str, x)),
)
def test_matches_transformers(variant, lengths):
    _, ours, ref = variant
    ids, mask = random_batch(lengths, seed=len(lengths) + max(lengths))
    assert_parity(ours, ref, ids, mask)


def test_real_text_and_invariance(variant):
    folder, ours, ref = variant
    ids, mask = tokenize(folder, ["It's time for tea.", "A much longer sentence " * 40, "x"])
    assert_parity(ours, ref, ids, mask)
    with torch.no_grad():
        alone = ours(ids[:1, : int(mask[0].sum())], mask[:1, : int(mask[0].sum())])
        batched = ours(ids, mask)[:1, : int(mask[0].sum())]
    torch.testing.assert_close(batched, alone, atol=ATOL, rtol=RTOL)


def test_full_size_base_at_300(tmp_path):
    folder = make_checkpoint(tmp_path / "full", "modernbert-base", seed=3)
    ours, ref = load_model(folder), hf_reference(folder)
    ids, mask = random_batch([300, 123], seed=3)
    assert_parity(ours, ref, ids, mask)


@pytest.mark.parametrize("arch", ["ModernBertForMaskedLM", "ModernBertForSequenceClassification",
                                  "ModernBertForTokenClassification"])
def test_heads(tmp_path, arch):
    extra = {} if arch == "ModernBertForMaskedLM" else dict(num_labels=3, classifier_pooling="mean")
    folder = make_checkpoint(tmp_path / "ck", arch=arch, seed=4, num_hidden_layers=3, local_attention=16, **extra)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert all(k.startswith(("model.", "head.", "decoder.", "classifier.")) for k in f.keys())
    ours, ref = load_model(folder), hf_reference(folder, arch)
    ids, mask = random_batch([40, 9], seed=4)
    assert_parity(ours, ref, ids, mask, head=True)
    if arch == "ModernBertForMaskedLM":
        assert ours.decoder.weight is ours.model.embeddings.tok_embeddings.weight
    # a head checkpoint loads as a bare encoder on request
    encoder = load_model(folder, task="encoder")
    with torch.no_grad():
        expected = ref.model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(encoder(ids, mask)[mask.bool()], expected[mask.bool()], atol=ATOL, rtol=RTOL)


def test_f16_stored_checkpoint_loads_as_fp32(tmp_path):
    folder = make_checkpoint(tmp_path / "f16", "gte-modernbert-base", seed=5, num_hidden_layers=3,
                             save_dtype=torch.float16)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("final_norm.weight").dtype == torch.float16
    ours = load_model(folder)
    assert ours.embeddings.tok_embeddings.weight.dtype == torch.float32
    assert_parity(ours, hf_reference(folder), *random_batch([50, 3], seed=5))
    assert load_model(folder, dtype=torch.float16).final_norm.weight.dtype == torch.float16


def test_sharded_checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path / "sh", seed=6, num_hidden_layers=3, shard_size="60MB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert_parity(load_model(folder), hf_reference(folder), *random_batch([70], seed=6))


def test_pytorch_bin_fallback(tmp_path):
    folder = make_checkpoint(tmp_path / "bin", seed=7, num_hidden_layers=2, local_attention=16)
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert_parity(load_model(folder), hf_reference(folder), *random_batch([33], seed=7))


def test_transformers5_config_keys(tmp_path):
    """A config re-saved with rope_parameters/layer_types (transformers 5) reads the same values."""
    import json

    folder = make_checkpoint(tmp_path / "t5", seed=8, num_hidden_layers=4, local_attention=16,
                             global_rope_theta=80000.0, local_rope_theta=5000.0)
    raw = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in raw and "layer_types" in raw  # save_pretrained writes the new form
    from mbert.modeling import load_config

    cfg = load_config(folder)
    assert (cfg.global_rope_theta, cfg.local_rope_theta) == (80000.0, 5000.0)
    assert [cfg.is_global(i) for i in range(4)] == [True, False, False, True]
    assert cfg.head_dim == 64 and cfg.window_half_width == 8


# ----------------------------------------------------------------------------- the suite can fail
def _inject(model, pitfall):
    bad = copy.deepcopy(model)
    if pitfall == "window-off-by-one":
        bad.window += 1
    elif pitfall == "thetas-swapped":
        bad.global_inv_freq, bad.local_inv_freq = bad.local_inv_freq.clone(), bad.global_inv_freq.clone()
    elif pitfall == "tanh-gelu":
        for layer in bad.layers:
            layer.mlp.act = lambda x: F.gelu(x, approximate="tanh")
    elif pitfall == "wi-halves-swapped":
        for layer in bad.layers:
            w = layer.mlp.Wi.weight.data
            layer.mlp.Wi.weight.data = torch.cat(w.chunk(2, dim=0)[::-1])
    elif pitfall == "attn-norm-on-layer-0":
        bad.layers[0].attn_norm = LayerNorm(bad.config.hidden_size, bad.config.norm_eps, False)
    elif pitfall == "no-padding-mask":
        inner = bad.forward
        bad.forward = lambda ids, mask: inner(ids, torch.ones_like(mask))
    return bad


@pytest.fixture(scope="module")
def pitfall_model(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("pit"), seed=9, num_hidden_layers=5, local_attention=32,
                             hidden_size=256, num_attention_heads=4, intermediate_size=384)
    return load_model(folder), hf_reference(folder)


@pytest.mark.parametrize("pitfall", ["window-off-by-one", "thetas-swapped", "tanh-gelu", "wi-halves-swapped",
                                     "attn-norm-on-layer-0", "no-padding-mask"])
def test_parity_check_catches_pitfall(pitfall_model, pitfall):
    ours, ref = pitfall_model
    ids, mask = random_batch([150, 60], seed=9)
    assert_parity(ours, ref, ids, mask)  # the unbroken model passes ...
    with pytest.raises(AssertionError):  # ... and each injected mistake fails the same check
        assert_parity(_inject(ours, pitfall), ref, ids, mask)
