"""The serving side runs without torch: opening and verifying a bundle, encoding on ONNX Runtime,
``mbert-run embed``, ``info`` and ``serve`` (a real tritonserver whose Python models load and answer),
in a Python where ``import torch`` fails (``sys.modules["torch"] = None``, set by a ``sitecustomize`` on
PYTHONPATH, so every child Python process is blocked too: the Triton Python backend's stubs included,
which the test checks). What needs the eager model says which extra to install, and exits 1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_mbert_run_serve_without_torch(bundles, tmp_path):
    """``mbert-run serve`` with torch blocked: the server gets ready and answers with the runtime's vectors."""
    from mbert.runtime import TritonEncoder

    needs_tritonserver()
    bundle = bundles.bundle("mean")
    command = [sys.executable, "-m", "mbert.runtime.cli", "serve", str(bundle), "--http-port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--ready-timeout", "240"]
    process = subprocess.Popen(command, env=torch_blocker(tmp_path), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("Ctrl-C stops it.")):
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
        assert lines and lines[-1].startswith("Ctrl-C stops it."), "".join(lines)[-3000:]
        http = next(x.split()[-1] for x in lines if x.strip().startswith("HTTP")).removeprefix("http://")
        got = TritonEncoder(http).encode(RUNTIME_TEXTS[:4])
        want = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(RUNTIME_TEXTS[:4])
        assert cosines(got, want).min() >= 0.999999
        os.killpg(process.pid, signal.SIGTERM)
        process.communicate(timeout=60)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# The Python backend's stub starts its interpreter isolated (PyConfig_InitIsolatedConfig): it ignores
# PYTHONPATH, so the sitecustomize block does not reach it. Its first sys.path entry is '' (its working
# folder, tritonserver's), ahead of site-packages, so a torch.py there shadows torch for every Python
# model: it records the attempt and fails the import.
SHADOW = """import sys
with open({marker!r}, "a") as f:
    f.write(repr(sys.argv) + "\\n")
sys.modules["torch"] = None
raise ImportError("import of torch halted (a Triton Python model may not load torch)")
"""


def stub_pids(server_pid: int) -> list[int]:
    """The Python-backend stub processes tritonserver ``server_pid`` started."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == server_pid and "stub" in (stat.parent / "cmdline").read_text():
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def test_triton_python_models_load_no_torch(bundles, tmp_path, monkeypatch):
    """The repository's Python models (tokenizer and encoder) load and answer in Triton with torch
    shadowed in their own interpreters, never try to import it, and map no torch library."""
    from mbert.bundle import open_bundle
    from mbert.runtime import TritonEncoder
    from mbert.runtime.serve.repository import ensemble_models, serving_copy
    from mbert.runtime.serve.server import TritonServer

    needs_tritonserver()
    bundle, marker = bundles.bundle("mean"), tmp_path / "torch-imports.txt"
    with open_bundle(bundle) as opened:
        repo = serving_copy(opened, None, tmp_path / "serve")
    assert len(list(repo.glob("*/1/model.py"))) == 2  # the tokenizer and the encoder
    shadow = tmp_path / "cwd"
    shadow.mkdir()
    (shadow / "torch.py").write_text(SHADOW.format(marker=str(marker)))
    monkeypatch.chdir(shadow)  # tritonserver and its stubs start here
    with TritonServer(repo, models=ensemble_models(repo), backend_cache=tmp_path / "backends",
                      env=torch_blocker(tmp_path), ready_timeout=240) as server:
        got = TritonEncoder(server.http_url).encode(RUNTIME_TEXTS[:4])
        stubs = stub_pids(server.process.pid)
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in stubs}
    want = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu").encode(RUNTIME_TEXTS[:4])
    assert cosines(got, want).min() >= 0.999999
    assert not marker.exists(), marker.read_text()  # no model even tried to import torch
    assert len(stubs) == 2 and any("onnxruntime" in m for m in maps.values())  # the maps show what is loaded
    assert not [pid for pid, m in maps.items() if "libtorch" in m or "/torch/" in m], maps.keys()


def test_the_shadow_blocks_torch(tmp_path):
    """The torch.py shadow in the working folder of an isolated Python with '' first on sys.path (as the
    stub runs) stops ``import torch`` and records it, so the test above would see a model that imports it."""
    marker = tmp_path / "torch-imports.txt"
    (tmp_path / "torch.py").write_text(SHADOW.format(marker=str(marker)))
    done = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, ''); import torch"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and "import of torch halted" in done.stderr and marker.is_file()


def needs_tritonserver() -> None:
    from mbert.runtime.serve.server import ServeError, find_tritonserver

    try:
        find_tritonserver()
    except ServeError as exc:
        pytest.skip(str(exc))
