"""The runtime on an ``--int8`` bundle: ``precision="int8"`` runs model.int8.onnx on ONNX Runtime CPU and
returns exactly what a plain ONNX Runtime session returns on the same inputs; the choices that cannot
run it are refused; ``mbert-run info`` shows the plan and its validation; ``mbert-run embed
--precision int8`` and parity use it; the manifest's INT8 records are cross-checked."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import RUNTIME_TEXTS as TEXTS
from helpers import edit_manifest, random_batch

from mbert.bundle.errors import BundleError, OptionError
from mbert.bundle.validation import INT8_TOLERANCES
from mbert.runtime import Encoder
from mbert.runtime.backends.onnxruntime import onnx_runner
from mbert.runtime.cli import main


@pytest.fixture(scope="module")
def int8(bundles):
    folder, _ = bundles.int8()
    return folder, Encoder.from_bundle(folder, precision="int8")


def test_int8_backend_output_equals_the_onnx_runtime_session(int8):
    folder, enc = int8
    assert (enc.backend_name, enc.backend.artifact, enc.precision) == ("onnxruntime-cpu", "model.int8.onnx", "int8")
    session = onnx_runner(folder / "model.int8.onnx")
    ids, mask = (t.numpy() for t in random_batch([120, 64, 7], seed=6))
    a, b, c = enc.backend.run(ids, mask), enc.backend.run(ids, mask), session(ids, mask)
    for name in c:
        assert np.array_equal(a[name], b[name]) and np.array_equal(a[name], c[name]), name
    # encode() of one text: the same padded batch through the session gives the same vector, exactly
    ids = np.array([enc.text.tokenizer.encode(TEXTS[1]).ids], dtype=np.int64)
    T = enc.backend.pad_to(ids.shape[1])
    padded = np.pad(ids, ((0, 0), (0, T - ids.shape[1])), constant_values=enc.pad_id)
    m = (np.arange(T) < ids.shape[1]).astype(np.int64)[None]
    assert np.array_equal(enc.encode(TEXTS[1]), session(padded, m)["sentence_embedding"][0])
    fp32 = Encoder.from_bundle(folder, device="cpu")
    assert fp32.precision == "fp32" and fp32.backend.artifact == "model.onnx"  # int8 only when asked


def test_int8_choices_that_cannot_run_it_are_refused(int8, bundles):
    folder, _ = int8
    for backend in ("onnxruntime-cuda", "tensorrt", "eager"):
        with pytest.raises(OptionError, match="precision='int8' runs model.int8.onnx on ONNX Runtime CPU"):
            Encoder.from_bundle(folder, backend=backend, precision="int8")
    with pytest.raises(OptionError, match="device='cuda' contradicts it"):
        Encoder.from_bundle(folder, device="cuda", precision="int8")
    assert Encoder.from_bundle(folder, backend="onnxruntime", precision="int8").backend_name == "onnxruntime-cpu"
    with pytest.raises(BundleError, match=r"no int8 graph.*re-export with --int8"):
        Encoder.from_bundle(bundles.bundle("mean"), precision="int8")


def test_check_parity_uses_the_int8_tolerances(int8):
    _, enc = int8
    report = enc.check_parity(texts=TEXTS)
    assert report.passed, report.table()
    assert {o.name: o.tolerance for o in report.outputs} == {n: INT8_TOLERANCES[n] for n in
                                                            ("last_hidden_state", "sentence_embedding")}


def test_cli_info_and_embed_with_int8(int8, tmp_path):
    folder, enc = int8
    runner = CliRunner()
    result = runner.invoke(main, ["info", str(folder)])
    assert result.exit_code == 0, result.output
    for needle in ("model.int8.onnx (int8", "INT8 plan (s8-7bit", "11 of 12 matrices INT8", "alone 1-cos",
                   "layers.1.mlp.Wi (alone moves", "top-10 neighbour agreement", "blind int8, all matrices",
                   "model.int8.onnx with precision int8"):
        assert needle in result.stdout, needle
    out = tmp_path / "v.jsonl"
    result = runner.invoke(main, ["embed", str(folder), *TEXTS[:4], "--precision", "int8", "--output", str(out),
                                  "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "(model.int8.onnx, int8)" in result.stderr
    got = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()])
    np.testing.assert_array_equal(got.astype(np.float32), enc.encode(TEXTS[:4]))


@pytest.mark.parametrize("edit", [lambda m: m.update(int8=None),
                                  lambda m: m.update(graphs=[g for g in m["graphs"] if g["precision"] != "int8"])])
def test_int8_graph_and_record_come_together(bundles, tmp_path, edit):
    copy = tmp_path / "b"
    shutil.copytree(bundles.int8()[0], copy)
    edit_manifest(copy, edit)
    with pytest.raises(BundleError, match="an int8 graph and the int8 plan record come together"):
        Encoder.from_bundle(copy)
