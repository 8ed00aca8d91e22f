"""``mbert-run serve`` and the C++ client (clients/cpp) as test fixtures.

``ServeCommand``: the command on free loopback ports, its banner read for the endpoints, the whole
process group stopped at the end.

    with ServeCommand(bundle) as served:       # started and ready (banner printed) on entry
        served.http_url, served.model          # "http://127.0.0.1:PORT", the ensemble's name

``start()`` and ``wait_ready()`` are separate so a caller can do other work (a build) while Triton
loads its models. ``build_cpp_client(folder)``: ``cmake -S clients/cpp -B folder && cmake --build folder``.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BANNER_END = "Ctrl-C stops it."
CPP_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "cpp"
CPP_PROGRAMS = ("mbert-embed", "mbert-embed-example", "mbert-embed-threads")


class BuildError(Exception):
    """The C++ client did not build: the message names the step and quotes its output."""


def build_cpp_client(build: Path, jobs: int = 2, timeout: float = 600) -> Path:
    """Configure and build clients/cpp into ``build`` (Release); the folder holding its programs."""
    import shutil

    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"{' and '.join(missing)} not found: run {CPP_CLIENT / 'install-deps.sh'} (as root)")
    steps = [["cmake", "-S", str(CPP_CLIENT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
             ["cmake", "--build", str(build), "-j", str(jobs)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise BuildError(f"`{' '.join(step)}` failed (status {done.returncode}; the libraries come from "
                             f"{CPP_CLIENT / 'install-deps.sh'}):\n{(done.stdout + done.stderr)[-3000:]}")
    absent = [p for p in CPP_PROGRAMS if not (build / p).is_file()]
    if absent:
        raise BuildError(f"the build made no {', '.join(absent)} in {build}")
    return build


class ServeCommand:
    def __init__(self, bundle: Path, *args: str, ready_timeout: float = 240.0):
        self.command = [sys.executable, "-m", "mbert.runtime.cli", "serve", str(bundle), "--host", "127.0.0.1",
                        "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                        "--ready-timeout", str(ready_timeout), *args]
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self.http_url = self.grpc_url = self.model = ""

    def start(self) -> "ServeCommand":
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        # stderr is drained by a thread for the command's whole life, so its writes never block
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.process.stderr:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> "ServeCommand":
        """Block until the banner's last line (AssertionError with the output when the command exits or
        the time runs out first); then the endpoints and the model are read from the banner."""
        deadline = time.monotonic() + self.ready_timeout + 30
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"mbert-run serve not ready after {self.ready_timeout + 30:.0f}s:\n"
                                     + "".join(self.lines)[-3000:]) from None
            if line is None:
                raise AssertionError(f"mbert-run serve exited with status {self.process.wait()}:\n"
                                     + "".join(self.lines)[-3000:])
            self.lines.append(line)
            if line.startswith(BANNER_END):
                break
        banner = "".join(self.lines)
        self.http_url = re.search(r"^\s+HTTP\s+(\S+)$", banner, re.M).group(1)
        self.grpc_url = re.search(r"^\s+gRPC\s+(\S+)$", banner, re.M).group(1)
        self.model = re.search(r"/v2/models/([^/\s]+)/infer", banner).group(1)
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the command's process group (it stops its server), SIGKILL after ``timeout``."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ServeCommand":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the group ended between the poll and the signal
        pass
