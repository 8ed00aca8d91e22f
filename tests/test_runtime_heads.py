"""mbert.runtime on head bundles (sequence / token classification, masked LM) against transformers,
plus the backend plumbing that needs no bundle: padding rules, TensorRT compatibility checks
(engine records made in the test; real engines only where a GPU a TensorRT family can use exists)."""
from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import LABELS, MAX_LEN
from helpers import RUNTIME_TEXTS as TEXTS
from trt_helpers import datacenter_record

from mbert.bundle import Gpu, Profile, open_bundle
from mbert.bundle.errors import BundleError, EngineError
from mbert.runtime import Encoder, check_engine, engine_compatibility, padded_length  # rules: test_tensorrt.py
from mbert.runtime.backends import open_backend
from mbert.runtime.backends.checks import check_graph_io
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.family import RTX_TARGETS, builder_available

GPU = current_gpu()
# A plan can be built and run here: a GPU, and datacenter TensorRT or TensorRT-RTX targeting it.
TRT_OK = GPU is not None and (builder_available("tensorrt").ok or (
    GPU.compute_capability in RTX_TARGETS and builder_available("tensorrt-rtx").ok))
TRT_REASON = f"no GPU a TensorRT family here can build for and run on (GPU: {GPU})"


def _hf(bundles, kind: str, cls_name: str):
    import transformers

    folder = bundles.checkpoint(kind)
    model = getattr(transformers, cls_name).from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


# --- sequence classification -----------------------------------------------------------------------

def test_predict_sequence_classification_equals_transformers(bundles):
    enc = Encoder.from_bundle(bundles.bundle("seqcls"))
    model, tok = _hf(bundles, "seqcls", "AutoModelForSequenceClassification")
    singles = TEXTS[:6]
    pairs = [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 8, 2)] + [(TEXTS[6], TEXTS[8])]  # the last two: truncated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_single = enc.predict(singles, batch_size=4)
        got_pairs = enc.predict(pairs)
    with torch.no_grad():
        batch = tok(singles, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        want_single = torch.softmax(model(**batch).logits, -1).numpy()
        a, b = zip(*pairs)
        batch = tok(list(a), list(b), padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        want_pairs = torch.softmax(model(**batch).logits, -1).numpy()
    for got, want in ((got_single, want_single), (got_pairs, want_pairs)):
        probs = np.array([[g["scores"][LABELS[j]] for j in range(3)] for g in got])
        np.testing.assert_allclose(probs, want, atol=1e-4)
        assert [g["label"] for g in got] == [LABELS[int(k)] for k in want.argmax(1)]
        assert all(abs(g["score"] - max(g["scores"].values())) < 1e-12 for g in got)
    assert enc.last_stats.truncated_indices == [3, 4]
    one = enc.predict(pairs[0])
    assert one["label"] == got_pairs[0]["label"]
    with pytest.raises(TypeError, match=r"texts\[1\] is tuple"):
        enc.predict(["a", ("b", "c", "d")])
    with pytest.raises(ValueError, match="encode needs an embedding"):
        enc.encode(["a"])


def test_predict_token_classification_equals_transformers(bundles):
    enc = Encoder.from_bundle(bundles.bundle("tokcls"))
    model, tok = _hf(bundles, "tokcls", "AutoModelForTokenClassification")
    texts = TEXTS[:4]
    got = enc.predict(texts)
    with torch.no_grad():
        batch = tok(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt",
                    return_special_tokens_mask=True)
        special = batch.pop("special_tokens_mask")
        probs = torch.softmax(model(**batch).logits, -1).numpy()
    for i, rows in enumerate(got):
        keep = np.flatnonzero((batch["attention_mask"][i] == 1).numpy() & (special[i] == 0).numpy())
        assert [r["index"] for r in rows] == keep.tolist()
        assert [r["label"] for r in rows] == [LABELS[int(k)] for k in probs[i, keep].argmax(-1)]
        np.testing.assert_allclose([r["score"] for r in rows], probs[i, keep].max(-1), atol=1e-4)
        assert all(texts[i][r["start"]:r["end"]] == r["text"] for r in rows)
    with pytest.raises(TypeError, match=r"texts\[0\] is tuple"):
        enc.predict([("a", "b")])


# --- masked LM -------------------------------------------------------------------------------------

def test_fill_mask_equals_transformers_pipeline(bundles):
    import transformers

    enc = Encoder.from_bundle(bundles.bundle("mlm"))
    folder = bundles.checkpoint("mlm")
    pipe = transformers.pipeline("fill-mask", model=str(folder), tokenizer=str(folder), device="cpu")
    text = "The capital of France is [MASK]."
    got = enc.fill_mask(text, top_k=5)
    want = pipe(text, top_k=5)
    assert [g["token"] for g in got] == [w["token"] for w in want]
    np.testing.assert_allclose([g["score"] for g in got], [w["score"] for w in want], atol=1e-5)
    assert [g["token_str"].strip() for g in got] == [w["token_str"].strip() for w in want]
    assert [g["sequence"] for g in got] == [w["sequence"] for w in want]
    model, tok = _hf(bundles, "mlm", "AutoModelForMaskedLM")
    with torch.no_grad():
        batch = tok([text], return_tensors="pt")
        pos = int((batch["input_ids"][0] == tok.mask_token_id).nonzero()[0, 0])
        probs = torch.softmax(model(**batch).logits[0, pos], -1).numpy()
    np.testing.assert_allclose([g["score"] for g in got], np.sort(probs)[::-1][:5], atol=1e-5)
    two = enc.fill_mask(["[MASK] is a city.", "Tea [MASK] good [MASK]."], top_k=3)
    assert len(two[0]) == 3 and len(two[1]) == 2 and all(len(r) == 3 for r in two[1])
    with pytest.raises(ValueError, match=r"text\[1\] has no \[MASK\]"):
        enc.fill_mask(["a [MASK]", "no mask here"])
    with pytest.raises(ValueError, match="fill_mask needs a masked-LM"):
        Encoder.from_bundle(bundles.bundle("seqcls")).fill_mask("a [MASK]")
    assert enc.check_parity(texts=TEXTS, max_len=32).passed


# --- padding rules -----------------------------------------------------------------------------------

def test_padded_length_rounds_to_8_and_respects_profiles():
    assert padded_length(1, 1, 128) == 8 and padded_length(9, 4, 128) == 16 and padded_length(125, 2, 128) == 128
    assert padded_length(130, 1, 130) == 130  # never beyond the max length, never below the input
    split = [Profile((1, 1), (8, 256), (16, 512)), Profile((1, 513), (8, 1024), (16, 2048))]
    assert padded_length(500, 4, 2048, split) == 504
    assert padded_length(510, 4, 2048, split) == 512  # rounded up to the short profile's max
    assert padded_length(513, 4, 2048, split) == 520
    long_only = [Profile((1, 64), (4, 128), (8, 256))]
    assert padded_length(10, 2, 256, long_only) == 64  # raised to the profile's minimum
    with pytest.raises(EngineError, match="no optimization profile accepts batch 32"):
        padded_length(10, 32, 256, long_only)


# --- TensorRT: compatibility checks with an engine record made here --------------------------------

# A datacenter plan built on an H100 with TensorRT 10.12 ("model.onnx" stands in for the plan file: no
# plan exists, only the checks run).
ENGINE = datacenter_record(file="model.onnx", version="10.12.0.36", profiles=(Profile((1, 1), (16, 128), (32, 128)),))


def _with_engine(bundle):
    """The bundle as opened, with ENGINE in its manifest."""
    return replace(bundle, manifest=replace(bundle.manifest, engine=ENGINE))


def test_plan_without_tensorrt_falls_back_or_explains(bundles):
    opened = open_bundle(bundles.bundle("cls"))
    faked = _with_engine(opened)
    with pytest.raises(BundleError, match=r"cannot run here: .*GPU compute capability: the plan was built for 9.0.*"
                                          r"mbert-export --engine-only "):
        check_engine(faked, Gpu("NVIDIA A100-SXM4-80GB", "8.0"))
    if GPU is None:
        assert open_backend(faked, "auto").name == "onnxruntime-cpu"
        with pytest.raises(BundleError, match="cannot run here: .*no CUDA GPU"):
            open_backend(faked, "tensorrt")
    with pytest.raises(ValueError, match="plan is FP16"):
        open_backend(faked, "tensorrt", precision="fp32")
    with pytest.raises(BundleError, match=r"outputs \['logits'\].*re-export"):
        check_graph_io(opened, "model.onnx", ["input_ids", "attention_mask"], ["logits"])


@pytest.mark.skipif(not TRT_OK, reason=f"TensorRT unavailable: {TRT_REASON}")
def test_tensorrt_backend_matches_onnx_runtime(bundles, tmp_path):  # pragma: no cover - needs a GPU
    import threading

    from mbert.export.options import ExportOptions
    from mbert.export.tensorrt.engine_only import build_for_bundle

    copy = bundles.copy("mean-fp16", tmp_path / "b")
    build_for_bundle(copy, ExportOptions(fp16=True, max_batch=8))
    trt_enc = Encoder.from_bundle(copy)
    assert trt_enc.backend_name == "tensorrt" and trt_enc.precision == "fp16"
    ort = Encoder.from_bundle(copy, backend="onnxruntime", device="cpu", precision="fp32")
    texts = TEXTS * 3
    want = ort.encode(texts)
    got = trt_enc.encode(texts, batch_size=5)
    assert (got * want).sum(1).min() >= 0.9999
    assert trt_enc.check_parity().passed
    results = [None] * 4
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, trt_enc.encode(texts))) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_allclose(r, got, atol=2e-3)


@pytest.mark.filterwarnings("ignore:.*truncated")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")
def test_gpu_machine_without_tensorrt_or_ort_cuda(bundles):  # pragma: no cover - needs a GPU
    from mbert.runtime.backends.onnxruntime import cuda_available

    assert GPU is not None and GPU.name
    opened = open_bundle(bundles.bundle("cls"))
    here = replace(ENGINE, built_on=GPU, version="10.99.0")
    assert engine_compatibility(here, family_version="10.99.0", compute_capability=GPU.compute_capability) == []
    eager = Encoder.from_bundle(bundles.bundle("cls"), backend="eager", device="cuda")
    ort = Encoder.from_bundle(bundles.bundle("cls"), backend="onnxruntime", device="cpu")
    np.testing.assert_allclose(eager.encode(TEXTS), ort.encode(TEXTS), atol=2e-3)
    assert eager.check_parity(max_len=256, source=bundles.checkpoint("cls")).passed  # CUDA eager vs CPU eager
    if not TRT_OK and not cuda_available()[0]:
        assert open_backend(opened, "auto").name == "onnxruntime-cpu"
        with pytest.raises(BundleError, match="neither TensorRT nor ONNX Runtime CUDA"):
            open_backend(opened, "auto", device="cuda")
