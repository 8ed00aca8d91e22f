"""The serving side runs without torch: opening and verifying a bundle, encoding on ONNX Runtime,
``mbert-run embed`` and ``info``, in a Python where ``import torch`` fails (``sys.modules["torch"] =
None``, set by a ``sitecustomize`` on PYTHONPATH, so every child Python process is blocked too). The
Triton Python models load under the same block in ``tests/test_triton_serve.py`` (its server runs with
it). What needs the eager model says which extra to install, and exits 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import RUNTIME_TEXTS, cosines, torch_blocker

from mbert.runtime import Encoder


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return torch_blocker(tmp_path_factory.mktemp("no-torch"))


def run(env, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True, timeout=180,
                          **kwargs)


def test_the_block_really_blocks_torch(env):
    done = run(env, "-c", "import torch")
    assert done.returncode != 0 and "import of torch halted" in done.stderr, done.stderr
    assert run(os.environ.copy(), "-c", "import torch").returncode == 0  # the test environment has it


def test_open_verify_and_encode_without_torch(bundles, env, tmp_path):
    bundle = bundles.bundle("mean")
    code = ("import sys, json, numpy as np\n"
            "from mbert.bundle import open_bundle\n"
            "from mbert.runtime import Encoder\n"
            "b = open_bundle(sys.argv[1])\n"
            "enc = Encoder.from_bundle(sys.argv[1], backend='onnxruntime', device='cpu')\n"
            "np.save(sys.argv[2], enc.encode(json.loads(sys.argv[3])))\n"
            "heavy = sorted(m for m, v in sys.modules.items() if v is not None and (m.split('.')[0] in ('torch', 'onnx',"
            " 'onnxscript', 'matplotlib') or m.startswith(('mbert.modeling', 'mbert.export'))))\n"
            "print(json.dumps(heavy))\n")
    done = run(env, "-c", code, bundle, tmp_path / "v.npy", json.dumps(RUNTIME_TEXTS))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    want = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(RUNTIME_TEXTS)
    got = np.load(tmp_path / "v.npy")
    assert got.shape == want.shape and cosines(got, want).min() >= 0.999999


def test_mbert_run_embed_and_info_without_torch(bundles, env, tmp_path):
    bundle = bundles.bundle("mean")
    out = tmp_path / "v.npy"
    done = run(env, "-m", "mbert.runtime.cli", "embed", bundle, *RUNTIME_TEXTS[:4], "--output", out, "--backend",
               "onnxruntime-cpu")
    assert done.returncode == 0, done.stderr
    want = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(RUNTIME_TEXTS[:4])
    assert cosines(np.load(out), want).min() >= 0.999999
    info = run(env, "-m", "mbert.runtime.cli", "info", bundle)
    assert info.returncode == 0, info.stderr
    rows = {line.split()[0]: line.split()[1:3] for line in info.stdout.splitlines()
            if line.split()[:1] in (["onnxruntime-cpu"], ["eager"])}
    assert rows["onnxruntime-cpu"][0] == "yes" and rows["eager"][0] == "no", info.stdout
    assert "pip install 'mbert-export[export]'" in info.stdout  # what the eager backend needs


@pytest.mark.parametrize("args", [("parity",), ("embed", "--backend", "eager", "a text")])
def test_what_needs_the_eager_model_names_the_extra(bundles, env, args):
    bundle = bundles.bundle("mean")
    done = run(env, "-m", "mbert.runtime.cli", args[0], bundle, *args[1:])
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'mbert-export[export]'" in lines[0], done.stderr
