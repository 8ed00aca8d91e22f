"""mbert.runtime.Encoder on embedding bundles: equality with sentence-transformers, prompts,
truncation, output kinds, input checks, thread safety, parity, and refusal of tampered bundles."""
from __future__ import annotations

import json
import random
import threading
import warnings
from dataclasses import replace

import numpy as np
import pytest
from helpers import MAX_LEN, PROMPTS, cosines, edit_manifest
from helpers import RUNTIME_TEXTS as TEXTS

from mbert.bundle.errors import BundleError
from mbert.runtime import Encoder


@pytest.fixture(scope="module")
def cls_encoder(bundles):
    return Encoder.from_bundle(bundles.bundle("cls"), backend="onnxruntime", device="cpu")


@pytest.fixture(scope="module")
def mean_encoder(bundles):
    return Encoder.from_bundle(bundles.bundle("mean"))


@pytest.fixture(scope="module")
def st_models(bundles):
    return {"cls": bundles.sentence_transformer("cls"), "mean": bundles.sentence_transformer("mean")}


# --- equality with sentence-transformers ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["cls", "mean"])
def test_encode_equals_sentence_transformers_in_any_order(kind, cls_encoder, mean_encoder, st_models):
    enc = {"cls": cls_encoder, "mean": mean_encoder}[kind]
    assert enc.backend_name == "onnxruntime-cpu" and enc.precision == "fp32"
    texts = TEXTS * 2
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    shuffled = [texts[i] for i in order]
    want = st_models[kind].encode(shuffled, batch_size=5, convert_to_numpy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = enc.encode(shuffled, batch_size=3)
    assert got.dtype == np.float32 and got.shape == want.shape == (len(texts), enc.dimension)
    assert cosines(got, want).min() >= 0.99999
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    stats = enc.last_stats
    assert stats.batches >= 4 and stats.padded_tokens > stats.tokens  # padded batches
    assert stats.truncated == sum(1 for t in shuffled if len(enc.text.encode([t])[0].overflowing) > 0) >= 2
    norms = np.linalg.norm(got, axis=1)
    if kind == "mean":  # declared Normalize
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    else:
        assert norms.min() > 2.0
    # the caller's order is restored: unshuffling equals encoding in the original order
    back = np.empty_like(got)
    back[order] = got
    np.testing.assert_allclose(back, enc.encode(texts, batch_size=7), atol=1e-5)


def test_normalize_override(cls_encoder, mean_encoder, st_models):
    texts = TEXTS[:6]
    raw = st_models["cls"].encode(texts, normalize_embeddings=False)
    unit = cls_encoder.encode(texts, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)
    assert cosines(unit, raw).min() >= 0.99999
    # the graph normalizes; normalize=False pools again from last_hidden_state
    st_mean = st_models["mean"]
    tokens = st_mean.encode(texts, output_value="token_embeddings")
    unnormalized = np.stack([t.numpy().mean(axis=0) for t in tokens])
    got = mean_encoder.encode(texts, normalize=False)
    np.testing.assert_allclose(got, unnormalized, atol=1e-4, rtol=1e-4)
    assert np.linalg.norm(got, axis=1).max() > 1.5


def test_bundle_without_pooling_mean_pools_like_sentence_transformers(cls_encoder, st_models):
    enc = Encoder(replace(cls_encoder.bundle, manifest=replace(cls_encoder.manifest, pooling=None)), cls_encoder.backend)
    with pytest.warns(UserWarning, match="declares no sentence-transformers pooling; using mean pooling"):
        got = enc.encode(TEXTS[:5])
    tokens = st_models["cls"].encode(TEXTS[:5], output_value="token_embeddings")
    np.testing.assert_allclose(got, np.stack([t.numpy().mean(axis=0) for t in tokens]), atol=1e-4, rtol=1e-4)
    assert enc.dimension == 128


@pytest.mark.parametrize("kind", ["cls", "mean"])
def test_prompts_match_sentence_transformers(kind, cls_encoder, mean_encoder, st_models):
    """cls keeps prompt tokens in pooling (graph pooling); mean excludes them (include_prompt false:
    pooling happens in the runtime from last_hidden_state, as sentence-transformers does)."""
    enc, st = {"cls": cls_encoder, "mean": mean_encoder}[kind], st_models[kind]
    texts = TEXTS[:5]
    for name in PROMPTS:
        want = st.encode(texts, prompt_name=name)
        got = enc.encode(texts, prompt_name=name)
        assert cosines(got, want).min() >= 0.99999, name
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    literal = enc.encode(texts, prompt=PROMPTS["query"])
    np.testing.assert_allclose(literal, enc.encode(texts, prompt_name="query"), atol=1e-6)
    assert cosines(literal, enc.encode(texts)).min() < 0.9999  # the prompt changed something
    with pytest.raises(ValueError, match="'nope'.*document, query"):
        enc.encode(texts, prompt_name="nope")


def test_default_prompt_name_is_honoured(mean_encoder):
    pooling = replace(mean_encoder.pooling, default_prompt_name="query")
    enc = Encoder(replace(mean_encoder.bundle, manifest=replace(mean_encoder.manifest, pooling=pooling)),
                  mean_encoder.backend)
    np.testing.assert_allclose(enc.encode(TEXTS[:4]), mean_encoder.encode(TEXTS[:4], prompt_name="query"), atol=1e-6)
    np.testing.assert_allclose(enc.encode(TEXTS[:4], prompt=""), mean_encoder.encode(TEXTS[:4]), atol=1e-6)


def test_token_output_matches_sentence_transformers(cls_encoder, st_models):
    texts = TEXTS[:7]
    got = cls_encoder.encode(texts, output="tokens", batch_size=4)
    want = st_models["cls"].encode(texts, output_value="token_embeddings")
    assert isinstance(got, list) and len(got) == len(texts)
    for g, w, t in zip(got, want, texts):
        assert g.dtype == np.float32 and g.shape == tuple(w.shape)
        assert g.shape[0] == min(MAX_LEN, len(cls_encoder.text.encode([t])[0].ids))
        np.testing.assert_allclose(g, w.numpy(), atol=1e-4, rtol=1e-4)


# --- inputs, truncation ----------------------------------------------------------------------------

def test_empty_single_and_bad_inputs(cls_encoder):
    empty = cls_encoder.encode([])
    assert empty.shape == (0, cls_encoder.dimension) and empty.dtype == np.float32
    assert cls_encoder.encode([], output="tokens") == []
    one = cls_encoder.encode(TEXTS[0])
    assert one.shape == (cls_encoder.dimension,)
    np.testing.assert_allclose(one, cls_encoder.encode(TEXTS[:1])[0], atol=1e-6)
    with pytest.raises(TypeError, match=r"texts\[2\] is int"):
        cls_encoder.encode(["a", "b", 3])
    with pytest.raises(TypeError, match=r"texts\[0\] is NoneType"):
        cls_encoder.encode([None])
    with pytest.raises(TypeError, match="expected a string or a list"):
        cls_encoder.encode(42)
    with pytest.raises(ValueError, match="output"):
        cls_encoder.encode(["a"], output="pooled")
    with pytest.raises(ValueError, match="predict"):
        cls_encoder.predict(["a"])


def test_truncation_is_counted_per_call_and_warned_once(cls_encoder):
    enc = Encoder(cls_encoder.bundle, cls_encoder.backend)
    long_text = TEXTS[6]
    assert enc.max_length == MAX_LEN
    with pytest.warns(UserWarning, match=r"1 of 2 inputs are longer than 128 tokens"):
        enc.encode(["short", long_text])
    assert enc.last_stats.truncated == 1 and enc.last_stats.truncated_indices == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        enc.encode([long_text, long_text, "x"])
        assert enc.last_stats.truncated == 2
        enc.encode(["x"])
        assert enc.last_stats.truncated == 0


def test_batches_are_padded_to_multiples_of_8_and_cut_by_token_budget(cls_encoder):
    seen = []
    backend = cls_encoder.backend
    original = backend.run

    class Spy:
        def __getattr__(self, name):
            return getattr(backend, name)

        def run(self, ids, mask, outputs=None):
            seen.append(ids.shape)
            return original(ids, mask, outputs)

    enc = Encoder(cls_encoder.bundle, Spy(), max_batch_tokens=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = enc.encode(TEXTS * 3, batch_size=8)
    assert all(t % 8 == 0 or t == MAX_LEN for _, t in seen)
    assert all(b * t <= 256 or b == 1 for b, t in seen) and max(b for b, _ in seen) <= 8
    np.testing.assert_allclose(out, cls_encoder.encode(TEXTS * 3), atol=1e-5)


# --- threads -------------------------------------------------------------------------------------

def test_concurrent_encode_equals_sequential(mean_encoder):
    rng = random.Random(1)
    jobs = [rng.sample(TEXTS * 2, 12) for _ in range(4)]
    prompts = [None, "query", None, "document"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sequential = [mean_encoder.encode(j, prompt_name=p, batch_size=5) for j, p in zip(jobs, prompts)]
        results, stats, errors = [None] * 4, [None] * 4, []
        barrier = threading.Barrier(4)

        def work(k):
            try:
                barrier.wait()
                for _ in range(3):
                    results[k] = mean_encoder.encode(jobs[k], prompt_name=prompts[k], batch_size=5)
                stats[k] = mean_encoder.last_stats.texts
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for got, want in zip(results, sequential):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert stats == [12, 12, 12, 12]


# --- parity, backends ----------------------------------------------------------------------------

def test_check_parity_fp32_and_fp16(bundles, cls_encoder):
    report = cls_encoder.check_parity()
    assert report.passed, report.table()
    assert {o.name for o in report.outputs} == {"last_hidden_state", "sentence_embedding"}
    assert all(o.tolerance.min_cosine == 0.99999 for o in report.outputs)
    fp16 = Encoder.from_bundle(bundles.bundle("mean-fp16"), backend="onnxruntime", precision="fp16")
    assert fp16.precision == "fp16" and fp16.backend.artifact == "model.fp16.onnx"
    report16 = fp16.check_parity(texts=TEXTS)
    assert report16.passed and report16.outputs[0].tolerance.min_cosine < 0.99999


def test_eager_backend_matches_onnx_and_names_missing_source(bundles, cls_encoder, tmp_path):
    eager = Encoder.from_bundle(bundles.bundle("cls"), backend="eager")
    assert eager.backend_name == "eager"
    np.testing.assert_allclose(eager.encode(TEXTS[:5]), cls_encoder.encode(TEXTS[:5]), atol=1e-4)
    copy = bundles.copy("cls", tmp_path / "b")
    edit_manifest(copy, lambda m: m["source"].update(path=str(tmp_path / "gone"), id=None, given="/data/ck"))
    with pytest.raises(BundleError, match=r"needs the checkpoint .*/data/ck.*source="):
        Encoder.from_bundle(copy, backend="eager")
    assert Encoder.from_bundle(copy).backend_name == "onnxruntime-cpu"  # ORT needs no source
    with pytest.raises(BundleError, match="needs the checkpoint"):
        Encoder.from_bundle(copy).check_parity()


def test_backend_choice_errors(bundles, tmp_path):
    with pytest.raises(ValueError, match="unknown backend"):
        Encoder.from_bundle(bundles.bundle("cls"), backend="cuda-magic")
    with pytest.raises(BundleError, match="no fp16 graph.*--fp16"):
        Encoder.from_bundle(bundles.bundle("cls"), precision="fp16")
    with pytest.raises(BundleError, match="no TensorRT engine.*--engine-only"):
        Encoder.from_bundle(bundles.bundle("cls"), backend="tensorrt")
    with pytest.raises(ValueError, match="eager backend is the FP32 reference"):
        Encoder.from_bundle(bundles.bundle("cls"), backend="eager", precision="fp16")


# --- tampering -----------------------------------------------------------------------------------

def test_swapped_model_file_is_refused(bundles, tmp_path):
    copy = bundles.copy("cls", tmp_path / "b")
    (copy / "model.onnx").write_bytes((bundles.bundle("mean") / "model.onnx").read_bytes())
    with pytest.raises(BundleError, match=r"model\.onnx differs from the file the manifest recorded"):
        Encoder.from_bundle(copy)


def test_missing_file_and_wrong_format_version_are_refused(bundles, tmp_path):
    copy = bundles.copy("cls", tmp_path / "b")
    (copy / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match=r"tokenizer\.json is missing"):
        Encoder.from_bundle(copy)
    copy2 = bundles.copy("cls", tmp_path / "c")
    edit_manifest(copy2, lambda m: m.update(format_version=99))
    with pytest.raises(BundleError, match=r"format_version 99 is an unknown bundle format.*re-export"):
        Encoder.from_bundle(copy2)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["model"].update(hidden_size=512), r"model\.hidden_size is 512 in the manifest, 128 in config\.json"),
    (lambda m: m["pooling"].update(normalize=True), r"pooling is .* but modules\.json"),
    (lambda m: m["io"]["outputs"].pop(), r"io\.outputs"),
    (lambda m: m.update(max_seq_len=100000), r"max_seq_len 100000 exceeds max_position_embeddings 8192"),
    (lambda m: m.update(task="masked-lm"), r"task is 'masked-lm' in the manifest"),
    (lambda m: m["graphs"][0].update(file="other.onnx"), r"graphs\[0\]\.file: 'other\.onnx' is not covered"),
])
def test_edited_manifest_is_refused(bundles, tmp_path, edit, message):
    copy = bundles.copy("cls", tmp_path / "b")
    edit_manifest(copy, edit)
    with pytest.raises(BundleError, match=message) as err:
        Encoder.from_bundle(copy)
    assert "re-export" in str(err.value).lower()


def test_manifest_digest_covers_values_no_file_records(bundles, tmp_path):
    from mbert.bundle.manifest import manifest_digest

    copy = bundles.copy("cls", tmp_path / "b")
    assert "manifest_sha256" in json.loads((copy / "manifest.json").read_text())  # the exporter seals it
    edit_manifest(copy, lambda m: m.update(manifest_sha256=manifest_digest(m)))
    assert Encoder.from_bundle(copy).max_length == MAX_LEN  # a sealed manifest opens
    edit_manifest(copy, lambda m: m.update(max_seq_len=64), reseal=False)
    with pytest.raises(BundleError, match=r"manifest_sha256 does not match .*edited after export"):
        Encoder.from_bundle(copy)


# --- pieces ----------------------------------------------------------------------------------------

def test_long_text_prefix_tokenization_equals_full_truncation():
    from pathlib import Path

    from tokenizers import Tokenizer

    from mbert.bundle.texts import calibration_texts
    from mbert.runtime.text import TextEncoder

    path = Path(__file__).parent / "fixtures" / "modernbert-base" / "tokenizer.json"
    rng = random.Random(0)
    texts = calibration_texts()
    texts += [t[a:] + " " + t[:a] for t in texts for a in (rng.randint(0, len(t)) for _ in range(3))]
    for max_len in (8, 37, 512):
        ours, ref = TextEncoder(path, max_len), Tokenizer.from_file(str(path))
        ref.enable_truncation(max_len)
        for a, b in zip(ours.encode(texts), ref.encode_batch(texts)):
            assert (a.ids, a.offsets, bool(a.overflowing)) == (b.ids, b.offsets, bool(b.overflowing))


@pytest.mark.parametrize("modes", [("cls",), ("mean",), ("max",), ("mean_sqrt_len_tokens",), ("weightedmean",),
                                   ("lasttoken",), ("cls", "mean", "max")])
def test_runtime_pooling_equals_sentence_transformers(modes):
    """Every pooling mode (and a concatenation) against sentence-transformers' own Pooling module."""
    import torch
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling as STPooling

    from mbert.runtime import pool

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 11, 8)).astype(np.float32)
    mask = np.zeros((3, 11), dtype=np.int64)
    for r, n in enumerate((11, 4, 1)):
        mask[r, :n] = 1
    st = STPooling(embedding_dimension=8, pooling_mode=modes if len(modes) > 1 else modes[0])
    want = st({"token_embeddings": torch.from_numpy(hidden), "attention_mask": torch.from_numpy(mask)})
    want = want["sentence_embedding"].numpy()
    np.testing.assert_allclose(pool(hidden, mask, modes, False), want, atol=1e-5)
    normed = want / np.linalg.norm(want, axis=-1, keepdims=True)
    np.testing.assert_allclose(pool(hidden, mask, modes, True), normed, atol=1e-5)


# --- arguments: unordered inputs and bad arguments are refused ----------------------------------------

def test_unordered_inputs_and_bad_arguments_are_refused(cls_encoder):
    with pytest.raises(TypeError, match="texts is a set, which has no order"):
        cls_encoder.encode({"a", "b"})
    with pytest.raises(TypeError, match="texts is a dict"):
        cls_encoder.encode({"a": 1})
    assert cls_encoder.encode(iter(["a", "b"])).shape == (2, cls_encoder.dimension)  # an iterator has an order
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {bad!r}"):
            cls_encoder.encode(["a"], batch_size=bad)
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive integer"):
        cls_encoder.encode(["a"], max_batch_tokens=0)
    for bad in ("no", 0, 1):
        with pytest.raises(TypeError, match="normalize must be True, False or None"):
            cls_encoder.encode(["a"], normalize=bad)
    with pytest.raises(ValueError, match=r"texts\[1\] is not valid Unicode text: surrogates not allowed at position 3"):
        cls_encoder.encode(["fine", "bad\ud800text"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Encoder.from_bundle(cls_encoder.path, batch_size=0)
