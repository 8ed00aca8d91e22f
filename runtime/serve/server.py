"""Run a real Triton Inference Server on a bundle's model repository (``<bundle>/triton/``).

    with TritonServer(Path("engines/gte/triton")) as server:   # free loopback ports
        server.http_url, server.grpc_url, server.metrics_url

``mbert-run serve BUNDLE [--http-port N] [--grpc-port N] [--metrics-port N] [--encoder ...]``
(:mod:`mbert.runtime.cli.serve`) is the same from the command line: it waits until the server is
ready, prints the endpoints and a ``curl`` example, forwards SIGINT/SIGTERM and exits when Triton
has shut down.

Where ``tritonserver`` comes from (:func:`find_tritonserver`): the ``nvidia-pytriton`` wheel
(``pip install 'mbert-export[serve]'``: its ``tritonserver`` with the Python backend, its libraries
in ``nvidia_pytriton.libs/``, and one Python-backend stub per Python version), else a
``tritonserver`` on PATH (NVIDIA's containers, with their own backends). For the wheel, a backends
folder is prepared once per user (``~/.cache/mbert-export/triton-backends/...``: the Python backend
plus the stub of the running Python); the Python models then run in the Python that runs this code
(its ``bin`` is put first on PATH, its ``libpython`` first on the loader path), so they import this
package and its ONNX Runtime.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path
from typing import Sequence

from mbert.bundle.errors import BundleError, MbertError

__all__ = ["ServeError", "TritonInstall", "TritonServer", "find_tritonserver", "prepare_backends", "free_port",
           "check_port", "SHM_PREFIX", "remove_shm"]

_counter = itertools.count()
_ERROR_LINE = re.compile(r"^(E\d{4} |\[libprotobuf ERROR|error: )")


class ServeError(MbertError):
    """tritonserver is missing, exited, or did not become ready (the message has its log's tail)."""


@dataclass(frozen=True)
class TritonInstall:
    """A ``tritonserver`` and what it needs to run."""

    executable: Path
    lib_dirs: tuple[Path, ...] = ()  # prepended to LD_LIBRARY_PATH
    python_backend: Path | None = None  # folder with libtriton_python.so to copy (None: server's own)
    stub: Path | None = None  # triton_python_backend_stub for the running Python
    origin: str = "PATH"


def find_tritonserver() -> TritonInstall:
    """The ``tritonserver`` of the installed nvidia-pytriton wheel, else one on PATH."""
    spec = importlib_util.find_spec("pytriton")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        dist = root / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        exe = dist / "bin" / "tritonserver"
        if exe.is_file():
            if not stub.is_file():
                raise ServeError(f"nvidia-pytriton at {root} has no Python backend stub for Python "
                                 f"{version} ({stub}); use a Python it ships stubs for")
            libs = root.parent / "nvidia_pytriton.libs"
            return TritonInstall(exe, (libs,) if libs.is_dir() else (), dist / "backends" / "python",
                                 stub, f"nvidia-pytriton ({root})")
    found = shutil.which("tritonserver")
    if found:
        return TritonInstall(Path(found))
    raise ServeError("no tritonserver found: pip install 'mbert-export[serve]' (nvidia-pytriton "
                     "ships one), or put NVIDIA's tritonserver on PATH")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbert-export" / "triton-backends"


def prepare_backends(install: TritonInstall, cache: Path | None = None) -> Path | None:
    """A backends folder holding ``python/`` (the wheel's Python backend and the stub of this
    Python), made once under ``cache`` (default: the per-user cache); None for a tritonserver that
    brings its own backends."""
    if install.python_backend is None or install.stub is None:
        return None
    stub_size = install.stub.stat().st_size
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{stub_size}"
    target = (cache or _cache_root()) / tag
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".backends-", dir=target.parent))
    try:
        shutil.copytree(install.python_backend, stage / "python",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(install.stub, stage / "python" / "triton_python_backend_stub")
        try:
            os.replace(stage, target)
        except OSError:  # prepared concurrently by another process
            if not (target / "python" / "triton_python_backend_stub").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


SHM_PREFIX = "mbert"  # the Python backend's shared-memory segments: /dev/shm/mbert<pid>_<n>_*


def remove_shm(prefix: str) -> None:
    """Remove the shared-memory segments whose names start with ``prefix`` (a stopped server's)."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        for path in shm.glob(f"{prefix}*"):
            path.unlink(missing_ok=True)


def check_port(host: str, port: int, option: str) -> None:
    """ServeError naming ``option`` when ``port`` on ``host`` is taken (nothing is left bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # as Triton binds: a port a stopped server left in TIME_WAIT is free (without SO_REUSEADDR,
        # it reads as taken for a minute after each serve that answered a request)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ServeError(f"port {port} on {host} ({option}) is in use ({exc.strerror or exc}); choose another "
                             f"with {option}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServer:
    """A ``tritonserver`` process on ``repository``, as a context manager (started and ready on
    entry, stopped on exit, even when the body raised).

    ``models=None`` loads every model and keeps serving when some fail (so their states can be
    inspected: ``/v2/repository/index``); a list loads just those (explicit model control) and
    fails fast. Ports default to free ones; ``host`` is the address every endpoint binds.
    ``log``: a file for Triton's output (default: a temporary file; ``"-"``: this process's own
    stdout/stderr). ``env``: variables set for the server and its Python models on top of this
    process's environment. The Python backend's shared-memory segments (``/dev/shm/{SHM_PREFIX}PID_N_*``)
    are removed when the server has stopped, however it ended.
    """

    def __init__(self, repository: str | Path, *, http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, host: str = "127.0.0.1", models: Sequence[str] | None = None,
                 log: str | Path | None = None, ready_timeout: float = 300.0,
                 install: TritonInstall | None = None, backend_cache: Path | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None):
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise BundleError(f"{self.repository}: model repository not found")
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = (
            port or free_port(host) for port in (http_port, grpc_port, metrics_port))
        self.models = list(models) if models is not None else None
        self.ready_timeout = ready_timeout
        self.install = install or find_tritonserver()
        self.backend_cache, self.extra_args, self.env = backend_cache, list(extra_args), dict(env or {})
        self.shm_prefix = f"{SHM_PREFIX}{os.getpid()}_{next(_counter)}_"
        self._log_arg = log
        self.log_path: Path | None = None
        self._temporary_log = False
        self.process: subprocess.Popen | None = None

    # --- endpoints ---------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # --- lifecycle ---------------------------------------------------------------------------------
    def command(self, backends: Path | None) -> list[str]:
        args = [str(self.install.executable), f"--model-repository={self.repository}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--exit-timeout-secs=10",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"]
        if backends is not None:
            args.append(f"--backend-directory={backends}")
        if self.models is None:
            args += ["--exit-on-error=false", "--strict-readiness=false"]
        else:
            args += ["--model-control-mode=explicit"] + [f"--load-model={m}" for m in self.models]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.install.stub is None:
            return env
        libdir = sysconfig.get_config_var("LIBDIR")  # the running Python's libpython, for the stub
        dirs = [libdir] if libdir and Path(libdir).is_dir() else []
        dirs += [str(d) for d in self.install.lib_dirs]
        env["LD_LIBRARY_PATH"] = ":".join(dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def start(self) -> "TritonServer":
        backends = prepare_backends(self.install, self.backend_cache)
        if self._log_arg == "-":
            out = None
        else:
            if self._log_arg is None:
                fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self.log_path, self._temporary_log = Path(name), True
            else:
                self.log_path = Path(self._log_arg)
            out = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(self.command(backends), env=self.environment(), stdout=out,
                                            stderr=subprocess.STDOUT if out else None,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_stop_with_parent)
        finally:
            if out is not None:
                out.close()
        return self

    def wait_ready(self) -> "TritonServer":
        """Block until ``/v2/health/ready`` answers 200; ServeError (with the log's tail) when the
        server exits first or ``ready_timeout`` passes."""
        deadline = time.monotonic() + self.ready_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while True:
            code = self.process.poll() if self.process else -1
            if code is not None:
                raise ServeError(f"tritonserver exited with status {code} before it was ready "
                                 f"(repository {self.repository}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"tritonserver was not ready after {self.ready_timeout:.0f}s "
                                 f"(repository {self.repository}):\n{self.log_tail()}")
            time.sleep(0.25)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton finishes in-flight requests), then SIGKILL after ``timeout``; then the
        server's shared-memory segments go."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        remove_shm(self.shm_prefix)
        return self.process.returncode

    def log_tail(self, lines: int = 12) -> str:
        """Triton's error lines (glog ``E...``, protobuf parse errors, ``error: ...``), then the
        last ``lines`` lines of its log."""
        if self.log_path is None or not self.log_path.is_file():
            return "(log on the console)"
        text = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in text if _ERROR_LINE.match(line)]
        tail = [line for line in text[-lines:] if line not in errors]
        return "\n".join(errors + ["..."] + tail)

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        """Stop the server; a temporary log goes too (errors raised here carry its tail)."""
        self.stop()
        if self._temporary_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def _stop_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when its parent dies, so a killed test run or
    ``mbert-run serve`` leaves no server behind. (Linux sends it when the *thread* that started the
    server ends: start servers from a thread that outlives them, as the main thread does.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


