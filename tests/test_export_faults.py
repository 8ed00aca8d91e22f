"""The export as a transaction, under bad input and faults (one section per rule, one or more tests
each), driven through the ``mbert-export`` command line as a user would."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, error_line, make_checkpoint, snapshot, tiny_bundle, tiny_checkpoint, write_json
from helpers import export_cli as cli

from mbert.bundle import open_bundle


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory, "faults", seed=40)


@pytest.fixture(scope="module")
def exported(ck, tmp_path_factory) -> Path:
    return tiny_bundle(ck, tmp_path_factory, "exported")


# --overwrite replaces only a sealed bundle ------------------------------------------------------------

def test_overwrite_refuses_a_folder_that_is_not_a_bundle(ck, tmp_path):
    ext = tmp_path / "web-extension"
    ext.mkdir()
    write_json(ext / "manifest.json", {"manifest_version": 3, "name": "my extension"})
    (ext / "background.js").write_text("console.log('hi')")
    before = snapshot(ext)
    proc = cli(ck, "--out", ext, "--overwrite", "--max-seq-len", "64")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "--overwrite replaces only a folder that holds a bundle of mbert-export and nothing else" in line
    assert "manifest.json has no known mbert-export format_version" in line
    assert snapshot(ext) == before


def test_overwrite_replaces_a_bundle_of_this_tool(ck, exported, tmp_path):
    import shutil

    out = tmp_path / "b"
    shutil.copytree(exported, out)
    old = json.loads((out / "manifest.json").read_text())["created"]
    time.sleep(1.1)
    proc = cli(ck, "--out", out, "--overwrite", "--max-seq-len", "64")
    assert proc.returncode == 0, proc.stderr
    assert open_bundle(out).manifest.created != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


# modules.json paths stay inside the checkpoint --------------------------------------------------------

def test_modules_json_paths_are_confined(ck, tmp_path):
    import shutil

    evil = tmp_path / "ck-evil"
    shutil.copytree(ck, evil)
    modules = json.loads((evil / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "../escape", "type": "sentence_transformers.models.Normalize"})
    write_json(evil / "modules.json", modules)
    (tmp_path / "escape").mkdir()
    write_json(tmp_path / "escape" / "config.json", {"planted": True})
    out = tmp_path / "exports" / "b"
    proc = cli(evil, "--out", out, "--max-seq-len", "64")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "modules.json" in line and "'../escape/config.json'" in line and "leads out of its folder" in line
    assert not (tmp_path / "exports" / "escape").exists() and not out.exists()


# --max-seq-len: below 2 is refused before any work; 2 keeps the sequence axis dynamic ----------------

@pytest.mark.parametrize("value", ["0", "1", "-5"])
def test_too_small_max_seq_len_is_refused_before_any_work(ck, tmp_path, value):
    proc = cli(ck, "--out", tmp_path / "b", "--max-seq-len", value)
    assert proc.returncode == 2
    assert "--max-seq-len must be an integer >= 2" in error_line(proc) and "[2/4] trace" not in proc.stderr
    assert not (tmp_path / "b").exists()


def test_smallest_max_seq_len_keeps_the_sequence_axis_dynamic(ck, tmp_path):
    import numpy as np
    import onnx

    from mbert.runtime import Encoder

    proc = cli(ck, "--out", tmp_path / "b", "--max-seq-len", "2")
    assert proc.returncode == 0, proc.stderr
    graph = onnx.load(str(tmp_path / "b" / "model.onnx"), load_external_data=False).graph
    assert [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input] == [["batch", "sequence"]] * 2
    enc = Encoder.from_bundle(tmp_path / "b")
    with pytest.warns(UserWarning, match="truncated"):
        vectors = enc.encode(["a long text, cut to two tokens", "x", ""])
    assert vectors.shape == (3, 128) and np.isfinite(vectors).all()


# a killed export's .NAME.partial-PID folder is cleaned up; SIGTERM ------------------------------------

def _start(ck: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mbert.export.cli", str(ck), "--out", str(out),
                             "--max-seq-len", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_partial(proc: subprocess.Popen, parent: Path, holding: str | None = None) -> Path:
    """The staging folder of the running export, once it exists (and holds ``holding``, if given)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = [p for p in parent.glob(".*.partial-*") if holding is None or (p / holding).exists()]
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("the export never started writing")


def test_sigterm_is_an_interrupt_and_leaves_nothing(ck, tmp_path):
    proc = _start(ck, tmp_path / "b")
    _wait_for_partial(proc, tmp_path)  # the export has started (the trace alone takes seconds)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted: no bundle was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_next_export_removes_what_a_killed_one_left(ck, tmp_path):
    proc = _start(ck, tmp_path / "b")
    partial = _wait_for_partial(proc, tmp_path, holding="model.onnx")
    proc.kill()  # kill -9: no handler runs
    proc.communicate(timeout=60)
    assert partial.exists()
    again = cli(ck, "--out", tmp_path / "other", "--max-seq-len", "64")  # another target, same parent
    assert again.returncode == 0, again.stderr
    assert f"removed {partial}" in again.stderr and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


# a second export to the same --out stops at once ------------------------------------------------------

def test_a_second_concurrent_export_to_the_same_out_stops_at_once(ck, tmp_path):
    from mbert.export.transaction import lock

    with lock(tmp_path / "b"):  # an export to b is running (this process holds its lock)
        started = time.monotonic()
        proc = cli(ck, "--out", tmp_path / "b", "--max-seq-len", "64")
        took = time.monotonic() - started
    assert proc.returncode == 1 and "another export to this folder is running" in error_line(proc)
    assert "[2/4] trace" not in proc.stderr and took < 120 and not (tmp_path / "b").exists()


# token ids beyond vocab_size are an input error, before the trace -------------------------------------

def test_special_token_id_beyond_the_embedding_table_names_the_config(tmp_path):
    folder = make_checkpoint(tmp_path / "ck", seed=41, **TINY)
    config = json.loads((folder / "config.json").read_text())
    write_json(folder / "config.json", dict(config, pad_token_id=60000))  # transformers cannot even build it
    proc = cli(folder, "--out", tmp_path / "b")
    assert proc.returncode == 1 and "[2/4] trace" not in proc.stderr
    line = error_line(proc)
    assert str(folder / "config.json") in line and "'pad_token_id' is 60000" in line and "vocab_size 50368" in line


def test_tokenizer_ids_beyond_the_embedding_table_name_the_tokenizer(tmp_path):
    folder = make_checkpoint(tmp_path / "ck", seed=42, vocab_size=50000, pad_token_id=0, cls_token_id=1,
                             sep_token_id=2, bos_token_id=1, eos_token_id=2, **TINY)
    proc = cli(folder, "--out", tmp_path / "b")
    assert proc.returncode == 1 and "[2/4] trace" not in proc.stderr
    line = error_line(proc)
    assert str(folder / "tokenizer.json") in line and "outside the model's embedding table (vocab_size 50000" in line


# options are checked before the trace and the scan ----------------------------------------------------

@pytest.mark.parametrize("args, code, message", [
    (["--margin", "0"], 2, "--margin must be a finite number >= 1"),
    (["--margin", "-3"], 2, "--margin must be a finite number >= 1"),
    (["--margin", "nan"], 2, "--margin must be a finite number >= 1"),
    (["--max-batch", "0"], 2, "--max-batch must be an integer >= 1"),
    (["--opt-batch", "64"], 2, "--opt-batch 64 exceeds --max-batch 32"),
    (["--workspace-gib", "-1"], 2, "--workspace-gib must be a positive number"),
    (["--calibration", "/no/such/texts.txt"], 1, "/no/such/texts.txt (text file): file not found"),
    (["--split-seq", "512,64"], 2, "--split-seq must be strictly increasing"),
    # datacenter TensorRT cannot be installed on this machine: named explicitly, it fails before the trace
    (["--engine", "tensorrt"], 2, "--engine tensorrt: tensorrt is not installed"),
])
def test_options_are_checked_before_any_work(ck, tmp_path, args, code, message):
    started = time.monotonic()
    proc = cli(ck, "--out", tmp_path / "b", "--fp16", "--max-seq-len", "1024", *args)
    assert proc.returncode == code and message in error_line(proc)
    assert "[1/8] load" not in proc.stderr and not (tmp_path / "b").exists()
    assert time.monotonic() - started < 60


# NaN weights are named by checkpoint file and tensor; input errors exit 1 -----------------------------

def test_non_finite_weights_name_the_checkpoint_tensor(ck, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ck-nan"
    shutil.copytree(ck, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["layers.1.mlp.Wo.weight"][3, 5] = float("nan")
    state["layers.0.attn.Wqkv.weight"][0, 0] = float("inf")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc = cli(bad, "--out", tmp_path / "b")
    assert proc.returncode == 1 and "[2/4] trace" not in proc.stderr
    line = error_line(proc)
    assert str(bad / "model.safetensors") in line
    assert "layers.0.attn.Wqkv.weight, layers.1.mlp.Wo.weight" in line and "partial" not in line
    assert torch.isnan(state["layers.1.mlp.Wo.weight"]).any()  # the file really held a NaN


def test_an_out_that_cannot_be_written_is_a_user_error(ck, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    proc = cli(ck, "--out", tmp_path / "a-file" / "b", "--max-seq-len", "64")
    assert proc.returncode == 1
    assert error_line(proc).startswith(f"error: {tmp_path / 'a-file'}")


def test_a_bug_is_exit_3_and_usage_is_exit_2(ck, tmp_path):
    usage = cli(ck, "--engine-only", tmp_path)
    assert usage.returncode == 2 and "give exactly one of MODEL" in usage.stderr
    assert cli("--no-such-option").returncode == 2


# without --out, "build the engine later" names the bundle folder --------------------------------------

@pytest.fixture(scope="module")
def fp16_exported(ck, tmp_path_factory):
    """``mbert-export CK --fp16 --no-engine`` run without --out, from an empty folder."""
    cwd = tmp_path_factory.mktemp("cwd")
    proc = cli(ck, "--fp16", "--no-engine", "--max-seq-len", "64", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc, cwd / "engines" / ck.name


def test_engine_later_line_names_the_bundle_not_the_staging_folder(ck, fp16_exported):
    proc, bundle = fp16_exported
    assert f"mbert-export --engine-only {Path('engines') / ck.name}\n" in proc.stdout + "\n"
    assert "partial" not in proc.stdout and (bundle / "model.fp16.onnx").is_file()


# a failed --engine-only keeps the plan and the bundle opens -------------------------------------------

def test_a_failed_engine_only_leaves_the_bundle_byte_identical(fp16_exported, tmp_path):
    """A real TensorRT-RTX build succeeds, then the precision walk fails: the bundle's precision.json
    (edited and resealed, as a careful hand-edit would be) keeps layer 0's MLP FP32 while the graph
    computes it in FP16."""
    import shutil

    from mbert.bundle.manifest import read, write
    from mbert.runtime import Encoder

    b = tmp_path / "b"
    shutil.copytree(fp16_exported[1], b)
    precision = json.loads((b / "precision.json").read_text())
    assert precision["plan"]["layers"][0]["mlp"] == "float16"
    precision["plan"]["layers"][0]["mlp"] = "float32"
    (b / "precision.json").write_text(json.dumps(precision))
    write(b, read(b, verify=False))  # resealed: the bundle opens, its plan now disagrees with its graph
    before = snapshot(b)
    proc = cli("--engine-only", b, "--engine", "tensorrt-rtx")
    assert proc.returncode == 1
    assert "built model.plan with TensorRT-RTX" in proc.stderr  # the walk runs on the network just built
    assert error_line(proc).startswith("error: TensorRT's network disagrees with the FP16 plan (model.fp16.onnx): "
                                       "layers.0.mlp: the plan keeps it FP32 but")
    assert snapshot(b) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert Encoder.from_bundle(b, precision="fp16").encode("still opens").shape == (128,)


def test_engine_only_adds_an_engine_to_a_bundle_without_one(fp16_exported, tmp_path):
    import shutil

    from mbert.bundle import open_bundle

    b = tmp_path / "b"
    shutil.copytree(fp16_exported[1], b)
    proc = cli("--engine-only", b)  # --engine auto: the builder installed here (TensorRT-RTX in the test extra)
    assert proc.returncode == 0, proc.stderr
    assert "engine: TensorRT-RTX" in proc.stderr and "(chosen by --engine auto" in proc.stderr
    m = open_bundle(b).manifest
    assert m.engine.family == "tensorrt-rtx" and m.engine.targets == ("8.0", "8.6", "8.9", "12.0")
    assert m.engine.precision_walk.passed and m.precision.naive_fp16_tensorrt is not None
    assert {"model.plan", "tensorrt_build.log", "tensorrt_precision.json"} <= set(m.files)
