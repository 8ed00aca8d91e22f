"""``mbert-run``: info / embed / parity through click's CliRunner, one-line errors, instant --help."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import RUNTIME_TEXTS as TEXTS
from helpers import edit_manifest

from mbert.bundle.errors import BundleError
from mbert.runtime import Encoder
from mbert.runtime.cli import main


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def encoder(bundles):
    return Encoder.from_bundle(bundles.bundle("mean"), device="cpu")


def _error_line(result, code: int = 1) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_help_is_instant_and_imports_nothing_heavy():
    code = ("import sys\nfrom mbert.runtime.cli import main\nheavy = [m for m in ('torch', 'onnxruntime', "
            "'tokenizers', 'numpy') if m in sys.modules]\nassert not heavy, heavy\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "embed" in done.stdout and "parity" in done.stdout and "info" in done.stdout


def test_info_summarizes_manifest_validation_and_backends(bundles, runner):
    result = runner.invoke(main, ["info", str(bundles.bundle("mean-fp16"))])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for needle in ("task encoder", "pooling     mean, normalize True", "prompts: query='search_query: '",
                   "FP16 precision plan", "model.fp16.onnx", "Validation at export", "files verified",
                   "onnxruntime-cpu   yes", "tensorrt          no", "auto picks: onnxruntime-cpu"):
        assert needle in out, needle


def test_embed_npy_jsonl_and_stdin(bundles, runner, encoder, tmp_path):
    npy = tmp_path / "v.npy"
    result = runner.invoke(main, ["embed", str(bundles.bundle("mean")), *TEXTS[:3], "--output", str(npy),
                                  "--prompt-name", "query", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "embedded 3 texts" in result.stderr and "with onnxruntime-cpu (model.onnx, fp32)" in result.stderr
    np.testing.assert_allclose(np.load(npy), encoder.encode(TEXTS[:3], prompt_name="query"), atol=1e-6)

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[:4]) + "\n", encoding="utf-8")
    out = tmp_path / "v.jsonl"
    result = runner.invoke(main, ["embed", str(bundles.bundle("mean")), "--input", str(src), "--output", str(out),
                                  "--no-normalize", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.array([r["embedding"] for r in rows]), encoder.encode(TEXTS[:4], normalize=False),
                               atol=1e-5)

    result = runner.invoke(main, ["embed", str(bundles.bundle("mean")), "--no-progress"], input="one\ntwo\n")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2


def test_parity_command(bundles, runner):
    result = runner.invoke(main, ["parity", str(bundles.bundle("cls")), "--max-len", "64"])
    assert result.exit_code == 0, result.output
    assert "parity: pass" in result.stdout and "sentence_embedding" in result.stdout


def test_errors_are_one_line_and_debug_shows_the_exception(bundles, runner, tmp_path):
    line = _error_line(runner.invoke(main, ["info", str(tmp_path / "nope")]))
    assert "no such bundle folder" in line
    line = _error_line(runner.invoke(main, ["embed", str(tmp_path / "nope"), "x"]))
    assert "no such bundle folder" in line
    copy = bundles.copy("cls", tmp_path / "b")
    edit_manifest(copy, lambda m: m["model"].update(vocab_size=7))
    line = _error_line(runner.invoke(main, ["embed", str(copy), "x"]))
    assert "model.vocab_size is 7 in the manifest" in line
    line = _error_line(runner.invoke(main, ["embed", str(bundles.bundle("cls")), "x", "--prompt-name", "nope"]), 2)
    assert "prompt_name 'nope'" in line
    result = runner.invoke(main, ["--debug", "info", str(copy)])
    assert result.exit_code != 0 and isinstance(result.exception, BundleError)
    usage = runner.invoke(main, ["embed", str(bundles.bundle("cls")), "x", "--output", str(tmp_path / "v.csv")])
    assert usage.exit_code == 2 and ".npy or .jsonl" in usage.stderr


# --- output names and text validation -----------------------------------------------------------------

def test_output_is_written_exactly_as_named(bundles, runner, encoder, tmp_path):
    for name in ("V.NPY", "v.Npy"):
        result = runner.invoke(main, ["embed", str(bundles.bundle("mean")), "x", "--output", str(tmp_path / name),
                                      "--no-progress"])
        assert result.exit_code == 0, result.output
        assert (tmp_path / name).is_file() and np.load(tmp_path / name).shape == (1, encoder.dimension)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["V.NPY", "v.Npy"]  # no V.NPY.npy, no temp files


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_a_missing_output_folder_is_one_error_for_every_format(bundles, runner, tmp_path, suffix):
    target = tmp_path / "missing" / f"v{suffix}"
    line = _error_line(runner.invoke(main, ["embed", str(bundles.bundle("mean")), "x", "--output", str(target)]))
    assert line == f"error: --output {target}: folder {target.parent} does not exist (create it first)"


def test_invalid_utf8_input_names_its_place(bundles, tmp_path):
    b = str(bundles.bundle("mean"))
    arg = subprocess.run([sys.executable.encode(), b"-m", b"mbert.runtime.cli", b"embed", b.encode(), b"ok",
                          b"bad \xff byte"], capture_output=True, timeout=300)
    assert arg.returncode == 1
    assert b"error: TEXT argument 2 is not valid UTF-8 (byte 0xff at position 4)" in arg.stderr
    stdin = subprocess.run([sys.executable, "-m", "mbert.runtime.cli", "embed", b], input=b"fine\nbad \xfe\n",
                           capture_output=True, timeout=300)
    assert stdin.returncode == 1
    assert b"error: standard input line 2: not valid UTF-8 (byte 0xfe at position 4)" in stdin.stderr
