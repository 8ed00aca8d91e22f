"""The C++ client (clients/cpp: the mbert::TritonEmbedder library and the mbert-embed program) built with
CMake and run against a real Triton (``mbert-run serve`` on a tiny bundle, loopback ports): its vectors
equal ``Encoder.encode``'s, its errors carry the server's message with the documented exit codes, and
8 threads x 100 requests through the library lose nothing.

No skip: a machine without the build tools or libraries fails here, naming clients/cpp/install-deps.sh
(``.ci/run`` runs it). One build and one served bundle for the module; the build runs while Triton loads.
"""
from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import RUNTIME_TEXTS, cosines
from serve_helpers import BuildError, ServeCommand, build_cpp_client

from mbert.bundle.texts import calibration_texts
from mbert.runtime import Encoder, TritonEncoder
from mbert.runtime.serve.server import free_port

MIN_COSINE = 0.999999
EMOJI = ["Tea time ☕🍵 with friends 👩‍👩‍👧‍👦, see you at 5!", "Ünïcödé façade, naïve café; 東京タワー, Москва 🚀"]
TEXTS = RUNTIME_TEXTS + calibration_texts() + EMOJI  # several past the bundle's 128 tokens
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Setup:
    build: Path
    served: ServeCommand
    bundle: Path
    encoder: Encoder

    @property
    def url(self) -> str:
        return self.served.http_url

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # truncation warning
            want = self.encoder.encode(texts)
        return want, list(self.encoder.last_stats.truncated_indices)

    def run(self, *args: str, program: str = "mbert-embed", stdin: str | bytes | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        done = subprocess.run([str(self.build / program), *args], input=data, capture_output=True,
                              timeout=timeout)
        done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
        return done

    def embed(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.run("--url", self.url, "--model", self.served.model, *args, **kwargs)


@pytest.fixture(scope="module")
def cpp(bundles, tmp_path_factory) -> Setup:
    bundle = bundles.bundle("mean")
    served = ServeCommand(bundle).start()
    try:
        try:
            build = build_cpp_client(tmp_path_factory.mktemp("cpp-client"))
        except BuildError as exc:
            pytest.fail(f"the C++ client did not build: {exc}")
        served.wait_ready()
        yield Setup(build, served, bundle, Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu"))
    finally:
        served.stop()


def rows(out: str) -> list:
    return [json.loads(line) for line in out.splitlines()]


# --- vectors equal to Encoder.encode ---------------------------------------------------------------

def test_program_equals_encoder_on_the_builtin_texts(cpp):
    done = cpp.embed("--details", "--", *TEXTS)  # "--": a text may start with "-"
    assert done.returncode == 0 and done.stderr == "", done.stderr
    got = rows(done.stdout)
    assert len(got) == len(TEXTS)
    vectors = np.array([g["embedding"] for g in got], dtype=np.float32)
    want, truncated = cpp.encode(TEXTS)
    assert cosines(vectors, want).min() >= MIN_COSINE
    assert cosines(vectors, np.roll(want, 1, axis=0)).max() < MIN_COSINE  # the check can fail
    # past the maximum length: cut, flagged, and counted at the maximum
    assert [i for i, g in enumerate(got) if g["truncated"]] == truncated and truncated
    lengths = [len(e.ids) for e in cpp.encoder.text.encode(TEXTS)]
    assert [g["num_tokens"] for g in got] == lengths and max(lengths) == cpp.encoder.max_length
    # full float32 precision: the same requests through the Python client give the same bits
    python = TritonEncoder(cpp.url.removeprefix("http://"), model=cpp.served.model).encode(TEXTS)
    np.testing.assert_array_equal(vectors, python)
    # without --details: the arrays alone, the same numbers
    plain = cpp.embed("--", *EMOJI)
    assert plain.returncode == 0
    assert [list(map(np.float32, r)) for r in rows(plain.stdout)] == vectors[-len(EMOJI):].tolist()


def test_thousand_lines_through_stdin(cpp):
    words = " ".join(TEXTS).split()
    lines = [f"{i}: " + " ".join(words[(i * 37) % 9000: (i * 37) % 9000 + 3 + i % 40]) for i in range(1000)]
    done = cpp.embed(stdin="\n".join(lines) + "\n", timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    vectors = np.array(rows(done.stdout), dtype=np.float32)
    assert vectors.shape[0] == 1000  # one line out per line in, in order:
    want, _ = cpp.encode(lines)
    assert cosines(vectors, want).min() >= MIN_COSINE
    assert cosines(vectors, np.roll(want, 1, axis=0)).max() < MIN_COSINE


def test_example_program(cpp):
    done = cpp.run(cpp.url, cpp.served.model, program="mbert-embed-example")
    assert done.returncode == 0, done.stderr
    # the README's example: "text I: D floats, first X, N tokens", checked against Encoder.encode
    texts = ["a query", "a document"]
    want, _ = cpp.encode(texts)
    lengths = [len(e.ids) for e in cpp.encoder.text.encode(texts)]
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for i, line in enumerate(lines):
        head, first, tokens = line.split(", ")
        assert head == f"text {i}: {want.shape[1]} floats" and tokens == f"{lengths[i]} tokens"
        assert abs(float(first.split()[1]) - want[i, 0]) < 1e-5 * max(1.0, abs(want[i, 0]))
    assert abs(want[0, 0] - want[1, 0]) > 1e-3  # the two texts' first values differ: the check can fail


# --- errors: exit status and one line on stderr ----------------------------------------------------

def one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_server_down_wrong_model_and_refused_requests(cpp):
    down = free_port()  # nothing listens there
    done = cpp.run("--url", f"http://127.0.0.1:{down}", "--model", cpp.served.model, "tea")
    assert done.returncode == 1 and done.stdout == ""
    line = one_line(done)  # libcurl's own words follow ("... after N ms: Couldn't connect to server")
    assert line.startswith(f"mbert-embed: Triton at http://127.0.0.1:{down}, model '{cpp.served.model}': a "
                           f"readiness check failed: Failed to connect to 127.0.0.1 port {down}")
    assert line.endswith("Couldn't connect to server")
    done = cpp.run("--url", cpp.url, "--model", "no-such-model", "tea")
    assert done.returncode == 1 and done.stdout == ""
    assert one_line(done) == (f"mbert-embed: Triton at {cpp.url}, model 'no-such-model' is not ready: Request "
                              "for unknown model: 'no-such-model' is not found")  # the server's message
    done = cpp.run("--url", cpp.url, "--model", f"{cpp.served.model}_python", "tea")
    assert done.returncode == 1 and "is not a bundle's ensemble: it must take TEXT" in one_line(done)
    # HTTP 400 with the server's own message; the texts before the failing chunk stay printed
    done = cpp.embed(stdin=b"tea\ncaf\xe9 au lait\n")
    assert done.returncode == 1 and done.stdout == ""
    assert one_line(done) == (f"mbert-embed: Triton at {cpp.url}, model '{cpp.served.model}' refused a request "
                              f"of 2 texts (HTTP 400): in ensemble '{cpp.served.model}', TEXT[1] is not valid "
                              "UTF-8 (invalid continuation byte at byte 3)")


def test_empty_input(cpp):
    """No input at all is an input error; an empty text (a blank line, an empty argument) is embedded as
    the runtime, the server and TritonEncoder embed it, so every input line keeps its output line."""
    done = cpp.embed(stdin="")
    assert (done.returncode, one_line(done), done.stdout) == (
        1, "mbert-embed: no input: no TEXT arguments and standard input is empty", "")
    texts = ["tea", "", "coffee"]
    want, _ = cpp.encode(texts)
    for kwargs, args in (({"stdin": "tea\n\ncoffee\n"}, ()), ({}, tuple(texts))):
        done = cpp.embed(*args, **kwargs)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        got = np.array(rows(done.stdout), dtype=np.float32)
        assert got.shape == want.shape and cosines(got, want).min() >= MIN_COSINE


def test_usage_errors_and_bad_urls(cpp):
    model = cpp.served.model
    cases = [
        (["--model", model, "tea"], "--url is required"),
        (["--url", cpp.url, "tea"], "--model is required"),
        (["--url", cpp.url, "--model", model, "--frobnicate", "tea"], "unknown option --frobnicate"),
        (["--url", cpp.url, "--model", model, "--timeout", "soon", "tea"],
         '--timeout must be a positive number of seconds, got "soon"'),
        (["--url", cpp.url.removeprefix("http://"), "--model", model, "tea"],
         f'--url: bad URL "{cpp.url.removeprefix("http://")}": Unsupported URL scheme (expected http://HOST:PORT)'),
        (["--url", "http://", "--model", model, "tea"], '--url: bad URL "http://": No host part in the URL'),
        (["--url", "ftp://127.0.0.1:8000", "--model", model, "tea"], 'scheme "ftp" is not http or https'),
        (["--url", f"{cpp.url}/v2", "--model", model, "tea"], "a path, query or fragment is not allowed"),
    ]
    for args, message in cases:
        done = cpp.run(*args)
        assert done.returncode == 2 and done.stdout == "", (args, done.stderr)
        usage, error = done.stderr.splitlines()
        assert usage.startswith("usage: mbert-embed --url") and error.startswith("mbert-embed: error: ")
        assert message in error, (args, error)
    help_ = cpp.run("--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: mbert-embed")


def test_a_server_that_never_answers_times_out(cpp):
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        done = cpp.run("--url", f"http://127.0.0.1:{port}", "--model", "m", "--timeout", "0.5", "tea", timeout=30)
    assert done.returncode == 1
    assert one_line(done).startswith(f"mbert-embed: Triton at http://127.0.0.1:{port}, model 'm': no answer to a "
                                     "readiness check within 500 ms (")


class _Malformed(http.server.BaseHTTPRequestHandler):
    """Answers like Triton (HTTP/1.1 keep-alive, max_batch_size 4, rows [0.5, -0.25]) until the
    inference reply, which is broken as ``server.flaw`` says; ``server.ports`` gets the client's port
    of every request."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self.server.ports.append(self.client_address[1])
        body = b"" if self.path.endswith("/ready") else json.dumps(
            {"max_batch_size": 4, "input": [{"name": "TEXT"}], "output": [{"name": "sentence_embedding"}]}).encode()
        self._send(body)

    def do_POST(self):  # noqa: N802
        self.server.ports.append(self.client_address[1])
        body = self.rfile.read(int(self.headers["Content-Length"]))
        n = json.loads(body[: int(self.headers["Inference-Header-Content-Length"])])["inputs"][0]["shape"][0]
        head = {"outputs": [{"name": "sentence_embedding", "datatype": "FP32", "shape": [n, 2],
                             "parameters": {"binary_data_size": 8 * n}},
                            {"name": "num_tokens", "datatype": "INT64", "shape": [n, 1], "data": [3] * n},
                            {"name": "truncated", "datatype": "BOOL", "shape": [n, 1], "data": [False] * n}]}
        binary = np.array([0.5, -0.25] * n, dtype="<f4").tobytes()
        flaw = self.server.flaw
        if flaw == "short binary":
            binary = binary[:6]
        if flaw == "no num_tokens":
            del head["outputs"][1]
        text = json.dumps(head).encode()
        if flaw == "not JSON":
            text = b"<html>" + text
        length = len(text) + (1000 if flaw == "header length" else 0)
        self._send(text + binary, {"Inference-Header-Content-Length": str(length)})

    def _send(self, body: bytes, headers: dict | None = None):
        self.send_response(200)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_malformed_replies(cpp):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Malformed)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        server.flaw, server.ports = None, []  # the well-formed reply is read (so each flaw below is what fails)
        good = cpp.run("--url", url, "--model", "m", "--details", *[f"tea {i}" for i in range(10)])
        assert good.returncode == 0 and rows(good.stdout) == [
            {"embedding": [0.5, -0.25], "num_tokens": 3, "truncated": False}] * 10, good.stderr
        # ready, config, then 10 texts in requests of max_batch_size 4: 5 requests on one connection
        assert len(server.ports) == 5 and len(set(server.ports)) == 1, server.ports
        assert cpp.run("--url", url, "--model", "m", "tea").returncode == 0
        assert len(set(server.ports)) == 2  # another client: another connection (the count can tell)
        for flaw, why in [("short binary", "binary data past the end of the body"),
                          ("no num_tokens", "no num_tokens output"),
                          ("not JSON", 'no JSON object with "outputs" (<html>'),
                          ("header length", "Inference-Header-Content-Length")]:
            server.flaw = flaw
            done = cpp.run("--url", url, "--model", "m", "tea")
            assert done.returncode == 1 and done.stdout == "", flaw
            assert one_line(done).startswith(f"mbert-embed: Triton at {url}, model 'm': unreadable reply to a "
                                             f"request of 1 text: {why}"), (flaw, done.stderr)
    finally:
        server.shutdown()
        server.server_close()


# --- threads ---------------------------------------------------------------------------------------

def test_eight_threads_of_a_hundred_requests(cpp):
    texts = RUNTIME_TEXTS + EMOJI
    done = cpp.embed("--threads", "8", "--requests", "100", *texts, program="mbert-embed-threads", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = rows(done.stdout)
    assert [(g["thread"], g["request"]) for g in got] == [(t, r) for t in range(8) for r in range(100)]  # none lost
    assert all("error" not in g for g in got)
    assert [g["text"] for g in got] == [(7 * t + r) % len(texts) for t in range(8) for r in range(100)]
    want, truncated = cpp.encode(texts)
    vectors = np.array([g["embedding"] for g in got], dtype=np.float32)
    index = np.array([g["text"] for g in got])
    assert cosines(vectors, want[index]).min() >= MIN_COSINE  # every answer equal to Encoder.encode's
    assert cosines(vectors, want[(index + 1) % len(texts)]).max() < MIN_COSINE
    assert {g["text"] for g in got if g["truncated"]} == set(truncated) and truncated
    summary = json.loads(done.stderr)
    assert summary["requests"] == 800 and summary["failed"] == 0


# --- the benchmark's smoke form --------------------------------------------------------------------

def test_benchmark_quick(cpp, tmp_path):
    out = tmp_path / "cpp_client_quick.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpp_client.py"), "--quick", "--out", str(out),
                           "--bundle", str(cpp.bundle), "--url", cpp.url, "--model", cpp.served.model,
                           "--cpp-build", str(cpp.build)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    assert {r["system"] for r in data["rows"]} == {"C++ mbert::TritonEmbedder", "Python TritonEncoder",
                                                   "in-process Encoder.encode"}
    for row in data["rows"]:
        assert row["texts"] == data["texts"] and row["failed"] == 0 and row["texts_per_s"] > 0
        assert f"| {row['system']} |" in report
    served = [r for r in data["rows"] if r["system"] != "in-process Encoder.encode"]
    assert len(served) == 2 and all(r["min_cosine"] >= MIN_COSINE and r["p99_ms"] >= r["p50_ms"] for r in served)
