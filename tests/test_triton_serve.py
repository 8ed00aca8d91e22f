"""A real Triton Inference Server (nvidia-pytriton's tritonserver, Python backend only, CPU) on a
bundle's repository: every model accepted by the server's own config parser, the ensemble equal to
``Encoder.encode`` over HTTP and gRPC, bad requests refused while the server stays up, a bounded
concurrent load on loopback, and ``mbert-run serve``'s start / signal / shutdown.

One server for the module (free loopback ports, bounded start, stopped even when a test fails).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from helpers import SMALL, make_checkpoint

from mbert.bundle import open_bundle
from mbert.bundle.errors import MbertError
from mbert.bundle.texts import calibration_texts
from mbert.export.options import ExportOptions
from mbert.export.pipeline import export_bundle
from mbert.export.tensorrt.build import profiles_from
from mbert.export.triton.writer import spec_for, write_triton_repository
from mbert.runtime import Encoder, TritonEncoder
from mbert.runtime.serve.models import TRUNCATED_METRIC
from mbert.runtime.serve.server import SHM_PREFIX, ServeError, TritonServer, find_tritonserver, prepare_backends

tritonclient_http = pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

MAX_LEN, MAX_BATCH = 512, 32
MIN_COSINE = 0.99999
PLAN_PLACEHOLDER = b"placeholder: this server has no TensorRT backend, so the plan is never read"
BROKEN = "zz_broken"


@dataclass
class Served:
    server: TritonServer
    bundle: Path
    name: str
    encoder: Encoder
    texts: list[str]
    want: np.ndarray
    want_truncated: list[int]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    try:
        find_tritonserver()
    except ServeError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("triton-serve")
    ck = make_checkpoint(root / "ck", base="gte-modernbert-base", layout="mean-normalize", seed=2, **dict(SMALL, num_hidden_layers=3))
    bundle = root / "bundle"
    export_bundle(ck, ExportOptions(out=bundle, max_seq_len=MAX_LEN))
    shutil.copytree(bundle, root / "sealed")  # untouched, for mbert-run serve (which verifies the bundle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation warning
        encoder = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
        texts = calibration_texts()
        want = encoder.encode(texts)
    manifest = open_bundle(bundle).manifest
    (bundle / "model.plan").write_bytes(PLAN_PLACEHOLDER)  # so the repository has a TensorRT model
    spec = replace(spec_for(manifest, max_batch=MAX_BATCH, ensemble_outputs=("sentence_embedding", "last_hidden_state")),
                   has_plan=True, profiles=tuple(profiles_from(MAX_BATCH, MAX_LEN)))
    repo = write_triton_repository(bundle, spec)
    # the ONNX Runtime model's config with one misspelt field: Triton's parser must refuse it
    # before it looks for the backend (shows the acceptance check can fail)
    broken = repo / BROKEN
    (broken / "1").mkdir(parents=True)
    text = (repo / f"{spec.model_name}_onnx" / "config.pbtxt").read_text()
    (broken / "config.pbtxt").write_text(text.replace(f'"{spec.model_name}_onnx"', f'"{BROKEN}"')
                                         .replace("max_batch_size:", "max_batch_sise:"))
    with TritonServer(repo, backend_cache=root / "backends", ready_timeout=240) as server:
        yield Served(server, bundle, spec.model_name, encoder, texts, want,
                     list(encoder.last_stats.truncated_indices))


def http_client(served: Served):
    return tritonclient_http.InferenceServerClient(served.server.http_url, network_timeout=60)


def statistics(served: Served, model: str) -> dict:
    return http_client(served).get_inference_statistics(model)["model_stats"][0]


def truncated_metric(served: Served) -> float:
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(TRUNCATED_METRIC + "{") and f'model="{served.name}_tokenizer"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{TRUNCATED_METRIC} not on {served.server.metrics_url}")


# --- the repository as the server sees it ---------------------------------------------------------

def test_server_accepts_every_model(served):
    client = http_client(served)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    name = served.name
    assert set(index) == {name, f"{name}_tokenizer", f"{name}_python", f"{name}_onnx", f"{name}_trt",
                          BROKEN}
    for model in (name, f"{name}_tokenizer", f"{name}_python"):
        assert index[model]["state"] == "READY", index[model]
    # the ONNX Runtime / TensorRT configs were parsed; only their backend is missing (this server
    # checks the backend before the tensors, so their semantic checks need a server with them)
    for model, backend in ((f"{name}_onnx", "onnxruntime"), (f"{name}_trt", "tensorrt")):
        assert index[model]["state"] == "UNAVAILABLE"
        assert f"unable to find backend library for backend '{backend}'" in index[model]["reason"]
    # a config the parser refuses gets no state at all: the server never reached its backend
    assert "state" not in index[BROKEN] and "version" not in index[BROKEN]
    assert f"Poll failed for model directory '{BROKEN}': failed to read text proto" in \
        served.server.log_path.read_text()
    # the server's own reading of the configs
    python = client.get_model_config(f"{name}_python")
    assert python["max_batch_size"] == MAX_BATCH
    assert all(i["allow_ragged_batch"] for i in python["input"])
    assert python["parameters"]["role"]["string_value"] == "encoder"
    ensemble = client.get_model_config(name)
    assert [s["model_name"] for s in ensemble["ensemble_scheduling"]["step"]] == \
        [f"{name}_tokenizer", f"{name}_python"]
    assert client.is_server_live()


# --- answers equal to Encoder.encode -------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_equals_encoder(served, protocol):
    url = served.server.http_url if protocol == "http" else served.server.grpc_url
    client = TritonEncoder(url, protocol=protocol)
    assert client.model == served.name and client.max_batch == MAX_BATCH
    batched = client.encode(served.texts)  # one request of 24 texts
    assert batched.dtype == np.float32 and batched.shape == served.want.shape
    assert cosines(batched, served.want).min() >= MIN_COSINE
    np.testing.assert_allclose(batched, served.want, atol=1e-5)
    assert cosines(batched, np.roll(served.want, 1, axis=0)).min() < MIN_COSINE  # the check can fail
    assert client.last_stats.truncated_indices == served.want_truncated and served.want_truncated
    assert client.last_stats.batches == 1
    single = np.stack([client.encode(t) for t in served.texts])  # one request per text
    assert cosines(single, served.want).min() >= MIN_COSINE
    small = client.encode(served.texts, batch_size=5)  # requests of 5
    assert client.last_stats.batches == 5 and cosines(small, served.want).min() >= MIN_COSINE
    assert client.encode([]).shape == (0, served.want.shape[1]) and client.last_stats.batches == 0
    with pytest.raises(TypeError, match=r"texts\[1\] is bytes"):
        client.encode(["tea", b"tea"])


def test_last_hidden_state_equals_encoder(served):
    client = TritonEncoder(served.server.grpc_url, protocol="grpc")
    texts = served.texts[:8]
    got = client.encode(texts, output="tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = served.encoder.encode(texts, output="tokens")
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert cosines(g, w).min() >= MIN_COSINE
        np.testing.assert_allclose(g, w, atol=1e-4)


# --- the tokenizer's length buckets ---------------------------------------------------------------

def test_tokenizer_pads_requests_to_length_buckets(served):
    client = http_client(served)
    texts = ["tea", "The quick brown fox jumps over the lazy dog, " * 2, "word " * 200]
    want = [e.ids for e in served.encoder.text.encode(texts)]
    assert [len(w) for w in want] == [4, 23, 203]
    for rows, bucket in (([0], 16), ([0, 1], 32), ([1, 2], 256)):
        result = _infer(client, f"{served.name}_tokenizer",
                        [("TEXT", np.array([[texts[i].encode()] for i in rows], dtype=object), "BYTES")])
        ids, mask = result.as_numpy("input_ids"), result.as_numpy("attention_mask")
        assert ids.shape == (len(rows), bucket)
        for r, i in enumerate(rows):
            n = len(want[i])
            assert ids[r, :n].tolist() == want[i] and mask[r].tolist() == [1] * n + [0] * (bucket - n)
            assert (ids[r, n:] == served.encoder.pad_id).all()
        assert result.as_numpy("num_tokens").ravel().tolist() == [len(want[i]) for i in rows]


# --- bad requests --------------------------------------------------------------------------------

def _infer(client, model, inputs):
    tensors = []
    for name, array, dtype in inputs:
        t = tritonclient_http.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    return client.infer(model, tensors)


def test_bad_requests_get_errors_and_the_server_stays_up(served):
    client = http_client(served)
    name = served.name
    text = lambda *rows: np.array([[r] for r in rows], dtype=object)  # noqa: E731
    cases = [
        ("non-UTF-8", name, [("TEXT", text(b"caf\xe9 au lait"), "BYTES")],
         r"TEXT\[0\] is not valid UTF-8 \(invalid continuation byte at byte 3\)"),
        ("wrong dtype", name, [("TEXT", np.array([[1.5]], dtype=np.float32), "FP32")],
         "data-type is 'FP32', but model .* expects 'BYTES'"),
        ("wrong shape", name, [("TEXT", np.array([[b"a", b"b"]], dtype=object), "BYTES")],
         r"unexpected shape for input 'TEXT'.*Expected \[-1,1\], got \[1,2\]"),
        ("batch over max_batch_size", name, [("TEXT", text(*[b"tea"] * (MAX_BATCH + 1)), "BYTES")],
         f"batch-size must be <= {MAX_BATCH}"),
        ("mask not right-padded", f"{name}_python",
         [("input_ids", np.ones((1, 4), dtype=np.int64), "INT64"),
          ("attention_mask", np.array([[1, 0, 1, 0]], dtype=np.int64), "INT64")],
         "attention_mask row 0 must be 1 to 512 ones then zeros"),
    ]
    for label, model, inputs, message in cases:
        with pytest.raises(InferenceServerException, match=message) as info:
            _infer(client, model, inputs)
        assert info.value.status() == "400", label
        assert client.is_server_live() and client.is_server_ready(), label

    # far past the maximum length: truncated exactly as the runtime truncates, and counted
    before = truncated_metric(served)
    long_text = "Tea time is a fine time. " * 40000  # ~1 MB, ~240k tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = served.encoder.encode([long_text, "short"])
        assert served.encoder.last_stats.truncated_indices == [0]
    result = _infer(client, name, [("TEXT", text(long_text.encode(), b"short"), "BYTES")])
    assert result.as_numpy("num_tokens").ravel().tolist() == [MAX_LEN, 3]
    assert result.as_numpy("truncated").ravel().tolist() == [True, False]
    assert cosines(result.as_numpy("sentence_embedding"), want).min() >= MIN_COSINE
    assert truncated_metric(served) == before + 1
    tokens = _infer(client, f"{name}_tokenizer", [("TEXT", text(long_text.encode()), "BYTES")])
    assert tokens.as_numpy("input_ids")[0].tolist() == served.encoder.text.encode([long_text])[0].ids
    assert client.is_server_ready()
    # and ordinary requests still work
    again = TritonEncoder(served.server.http_url).encode(served.texts[:3])
    assert cosines(again, served.want[:3]).min() >= MIN_COSINE


# --- load ----------------------------------------------------------------------------------------

def _mixed_texts() -> list[str]:
    """Deterministic texts of mixed lengths: prefixes of 3 to ~700 words of the built-in texts."""
    out = []
    for i, text in enumerate(calibration_texts()):
        words = text.split()
        for n in (3, 12, 40, 150, 700):
            if n <= len(words) or n == 3:
                out.append(" ".join(words[: n + i % 5]))
    return out


def test_concurrent_load(served):
    clients, per_client = 16, 50
    pool = _mixed_texts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = served.encoder.encode(pool)
    before = {m: statistics(served, m) for m in (f"{served.name}_tokenizer", f"{served.name}_python")}
    latencies: list[float] = []
    failures: list[str] = []
    worst = [1.0]
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        protocol = "http" if c % 2 == 0 else "grpc"
        try:
            enc = TritonEncoder(served.server.http_url if protocol == "http" else served.server.grpc_url,
                                model=served.name, protocol=protocol, timeout=120)
            for r in range(per_client):
                k = (c * 7 + r * 13) % len(pool)
                t0 = time.perf_counter()
                got = enc.encode([pool[k]])
                dt = time.perf_counter() - t0
                cos = float(cosines(got, want[k: k + 1]).min())
                with lock:
                    latencies.append(dt)
                    worst[0] = min(worst[0], cos)
        except (MbertError, OSError) as exc:
            with lock:
                failures.append(f"client {c}: {exc}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    wall = time.perf_counter() - start
    assert not any(t.is_alive() for t in threads), "load test clients hung"
    assert failures == []
    assert len(latencies) == clients * per_client  # none lost
    assert worst[0] >= MIN_COSINE

    # Triton counts a request after its response is sent, so the last ones may lag the answers: poll
    # until every model has counted them all, bounded in time (a count that never arrives fails below).
    deadline = time.monotonic() + 30
    while True:
        after = {m: statistics(served, m) for m in before}
        counted = all(after[m]["inference_count"] - before[m]["inference_count"] >= clients * per_client
                      for m in before)
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    python = f"{served.name}_python"
    inferences = after[python]["inference_count"] - before[python]["inference_count"]
    executions = after[python]["execution_count"] - before[python]["execution_count"]
    assert inferences == clients * per_client
    tok = f"{served.name}_tokenizer"
    assert after[tok]["inference_count"] - before[tok]["inference_count"] == clients * per_client
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in after[python]["batch_stats"]}
    assert executions < inferences and max(sizes) > 1  # requests shared batches
    lat = np.array(latencies) * 1000
    print(f"\nload: {clients} clients x {per_client} requests (1 text each, {len(pool)} distinct texts of "
          f"mixed lengths), {wall:.2f}s wall, {len(lat) / wall:.1f} req/s; latency p50 "
          f"{np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms; {python}: {inferences} "
          f"inferences in {executions} executions (mean batch {inferences / executions:.2f}); batch sizes "
          f"seen (all time): {dict(sorted(sizes.items()))}")


def test_an_empty_text_gets_the_runtime_answer_from_the_server_and_the_client(served):
    """One answer everywhere: an empty text embeds as ``[CLS] [SEP]``, as ``Encoder.encode([""])`` does
    (the server refused it with "TEXT[i] is empty", and so did TritonEncoder, while the runtime embedded it)."""
    want = served.encoder.encode(["", "tea"])
    lengths = [len(e.ids) for e in served.encoder.text.encode(["", "tea"])]
    assert lengths[0] == 2  # [CLS] [SEP]
    result = _infer(http_client(served), served.name,
                    [("TEXT", np.array([[b""], [b"tea"]], dtype=object), "BYTES")])
    assert result.as_numpy("num_tokens").ravel().tolist() == lengths
    assert cosines(result.as_numpy("sentence_embedding"), want).min() >= MIN_COSINE
    for protocol in ("http", "grpc"):
        url = served.server.http_url if protocol == "http" else served.server.grpc_url
        got = TritonEncoder(url, protocol=protocol).encode(["", "tea"])
        assert cosines(got, want).min() >= MIN_COSINE, protocol


# --- mbert-run serve -----------------------------------------------------------------------------

SERVE = [sys.executable, "-c", "from mbert.runtime.cli.serve import serve; serve()"]
GLOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # Triton's own log lines (glog: I1201 19:55:01.709 ...)


# A network namespace of the serve's own (root, as in CI): Triton's default ports are free there
# whatever listens on this machine's loopback; "exec" keeps the serve's pid, so signals reach it.
OWN_NETWORK = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def _start_serve(args: list, env: dict | None = None, own_network: bool = False) -> tuple[subprocess.Popen, list[str]]:
    """``mbert-run serve ARGS`` started (in a network namespace of its own when ``own_network``), and its
    standard error up to its "Ctrl-C stops it." line."""
    prefix = OWN_NETWORK if own_network else []
    process = subprocess.Popen([*prefix, *SERVE, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Ctrl-C stops it."):
            break
    return process, lines


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

def _in_network_of(process: subprocess.Popen, expression: str, texts: list[str]) -> np.ndarray:
    """``expression`` (an array; ``TEXTS`` is ``texts``) evaluated by a Python in ``process``'s network
    namespace."""
    code = ("import json, sys, numpy as np\nfrom mbert.runtime import TritonEncoder\n"
            f"TEXTS = json.loads(sys.argv[2])\nnp.save(sys.argv[1], {expression})\n")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "got.npy"
        done = subprocess.run(["nsenter", f"--net=/proc/{process.pid}/ns/net", sys.executable, "-c", code, str(out),
                               json.dumps(texts)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return np.load(out)


def test_serve_command_starts_answers_and_stops_on_signal(served):
    """With its defaults, as the README shows it (in a network namespace of its own, so the ports are free):
    Triton's ports 8000/8001/8002, ``TritonEncoder("localhost:8000")``
    answers; the console shows the endpoints and the curl line, not Triton's log (which goes to a file)."""
    sealed = served.bundle.parent / "sealed"
    process, lines = _start_serve([sealed, "--ready-timeout", "240"], own_network=True)
    try:
        banner = "".join(lines)
        assert "Ctrl-C stops it." in banner, banner[-3000:]
        endpoint = {x.split()[0]: x.split()[-1] for x in lines if x.startswith("  ")}
        assert (endpoint["HTTP"], endpoint["gRPC"]) == ("http://127.0.0.1:8000", "127.0.0.1:8001")
        assert endpoint["metrics"] == "http://127.0.0.1:8002/metrics"
        assert not [x for x in lines if GLOG_LINE.match(x) or "CUDA" in x or "NVML" in x], banner
        assert Path(endpoint["log"]).name == "tritonserver.log" and Path(endpoint["log"]).stat().st_size > 0
        http = endpoint["HTTP"]
        curl = next(x for x in lines if x.strip().startswith("try"))
        assert f"curl -s -X POST {http}/v2/models/{served.name}/infer" in curl
        got = _in_network_of(process, "TritonEncoder('localhost:8000').encode(TEXTS)", served.texts[:4])
        assert cosines(got, served.want[:4]).min() >= MIN_COSINE
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=60)[1]
        assert process.returncode == 0
        assert not [x for x in rest.splitlines() if GLOG_LINE.match(x)], rest[-3000:]  # the shutdown log too
        open_bundle(sealed)  # serving wrote nothing into the sealed bundle (no __pycache__)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_names_a_taken_port_in_one_line_and_leaves_nothing(served, tmp_path):
    """A port in use: one line naming it and its option, before Triton starts (it said "exited before
    it was ready (log on the console)" and left a shared-memory segment)."""
    sealed = served.bundle.parent / "sealed"
    shm_before = set(os.listdir("/dev/shm"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*SERVE, str(sealed), "--http-port", str(port), "--grpc-port", "0",
                               "--metrics-port", "0"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"Error: port {port} on 127.0.0.1 (--http-port) is in use "
                                                "(Address already in use); choose another with --http-port"]
    assert set(os.listdir("/dev/shm")) - shm_before == set() and list(tmp_path.iterdir()) == []


def test_a_killed_serve_leaves_a_folder_the_next_one_removes(served, tmp_path):
    """``kill -9`` of ``mbert-run serve``: its marked serve folder stays (no handler runs); the next serve
    command removes it, with its shared-memory segments, and nothing else named like it."""
    sealed = served.bundle.parent / "sealed"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    foreign = tmp_path / "mbert-serve-123-abcd"  # named like one, not marked: never touched
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's")
    process, lines = _start_serve([sealed, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                                   "--ready-timeout", "240"], env)
    try:
        assert lines and lines[-1].startswith("Ctrl-C stops it."), "".join(lines)[-3000:]
        folders = [p for p in tmp_path.glob("mbert-serve-*") if p != foreign and p.is_dir()]
        assert len(folders) == 1 and (folders[0] / "tritonserver.log").is_file()
        process.kill()  # kill -9 of the command; its tritonserver stops with its parent
        process.wait(timeout=60)
    finally:
        _stop(process)
    assert folders[0].is_dir()
    again = subprocess.run([*SERVE, str(tmp_path / "no-such-bundle"), "--http-port", "0", "--grpc-port", "0",
                            "--metrics-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 1 and "no-such-bundle" in again.stderr, again.stderr
    assert sorted(p.name for p in tmp_path.glob("mbert-serve-*")) == [foreign.name]  # folder and marker gone
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{process.pid}_")]


# --- the launcher's failure paths (no fixture server) ---------------------------------------------

def test_server_that_cannot_start_raises_with_its_log(tmp_path):
    try:
        install = find_tritonserver()
    except ServeError as exc:
        pytest.skip(str(exc))
    backends = prepare_backends(install, tmp_path / "backends")
    assert prepare_backends(install, tmp_path / "backends") == backends  # made once
    assert (backends / "python" / "triton_python_backend_stub").is_file()
    assert (backends / "python" / "libtriton_python.so").is_file()
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_sise: 1\n')
    server = TritonServer(repo, models=["broken"], install=install, backend_cache=tmp_path / "backends",
                          ready_timeout=120)
    with pytest.raises(ServeError, match=r"(?s)tritonserver exited with status 1 before it was ready.*"
                                         r"failed to read text proto"):
        with server:
            pass
    assert server.process.returncode == 1 and not server.log_path.exists()  # temporary log removed
