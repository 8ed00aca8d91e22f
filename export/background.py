"""Run a trace in a child process while the export goes on with eager work.

Tracing to ONNX is single-threaded Python (torch.export, decomposition, translation: ~50 s for
full-size ModernBERT-base), and the export traces twice (the FP32 graph, then the mixed graph once
the scan has chosen the plan). On a 2-core machine the second core idled through both. Measured
there (``benchmarks/results/export_time.md``): the scan of 20 texts took 42 s and the trace 50 s one
after the other; a trace in a child process beside the scan at two torch threads took 95 s for
both (three threads on two cores: every parallel region waits for the thread that lost its core),
beside the scan at one thread 66 s. So while a child runs the parent's torch runs one thread fewer
(:meth:`Jobs.threads`) and gets them back as soon as the child is done (:meth:`Jobs.poll`, called
between the parent's units of work).

The child is forked: it shares the loaded model copy-on-write (no second load, no import cost) and
traces on the CPU with one torch thread. Every object that exists at the fork is frozen out of the
garbage collector (``gc.freeze``) for the child: the child's collections then never run the
destructor of an inherited object, such as an ONNX Runtime session whose thread pool lived in the
parent (destroying it in the child waits forever on a condition variable of threads the child does
not have: a hang seen in the test suite before the freeze). It dies with the parent (``PR_SET_PDEATHSIG`` on Linux), so
a killed export leaves no process writing into its staging folder. Progress records, the result
and any error come back through a pipe; an error is raised in the parent as an ``ExportError`` with
the child's traceback attached as a note (``--debug`` shows it).
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any, Callable

import torch

from mbert.bundle.errors import ExportError
from mbert.export.progress import ProgressFn

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's exit still terminates daemon children
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child(send, parent: int, fn: Callable, args: tuple, kwargs: dict) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(1)
    try:
        result = fn(*args, **kwargs, progress=lambda p: send.send(("progress", p)))
        send.send(("ok", result, time.process_time()))
    except OSError as exc:  # a file that cannot be written (a full disk): raised as one in the parent
        send.send(("oserror", exc.errno, exc.strerror or str(exc), exc.filename, traceback.format_exc()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        send.send(("error", f"{type(exc).__name__}: {exc}", isinstance(exc, ExportError), traceback.format_exc()))
    finally:
        send.close()


class Job:
    """``fn(*args, **kwargs, progress=...)`` running in a forked child; :meth:`result` waits for it."""

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict):
        ctx = multiprocessing.get_context("fork")
        self.name = name
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(send, os.getpid(), fn, args, kwargs), daemon=True,
                                 name=f"mbert-{name}")
        self.t0 = time.perf_counter()
        gc.collect()  # the parent's garbage goes now, in the parent
        gc.freeze()  # what is left is never collected in the child (module docstring)
        try:
            self._proc.start()
        finally:
            gc.unfreeze()  # the parent collects as before
        send.close()
        self.elapsed_s: float | None = None  # wall time, set when the child's result arrived
        self.cpu_s: float | None = None  # the child's CPU time, when it succeeded
        self.reported = False  # its times were reported (Jobs.collect)
        self._outcome: tuple | None = None

    @property
    def done(self) -> bool:
        return self._outcome is not None

    @property
    def failed(self) -> bool:
        return self._outcome is not None and self._outcome[0] != "ok"

    def poll(self, progress: ProgressFn | None, timeout: float = 0.0) -> bool:
        """Forward what the child sent so far; True once its result (or error) is in."""
        while self._outcome is None and self._recv.poll(timeout):
            try:
                message = self._recv.recv()
            except EOFError:  # the child ended without a result: killed (OOM, signal)
                self._proc.join()
                self._outcome = ("died", self._proc.exitcode)
                break
            if message[0] == "progress":
                if progress is not None:
                    progress(message[1])
            else:
                self._outcome = message
            timeout = 0.0
        if self._outcome is not None and self.elapsed_s is None:
            self.elapsed_s = time.perf_counter() - self.t0
            self._proc.join()
        return self._outcome is not None

    def result(self, progress: ProgressFn | None = None) -> Any:
        while not self.poll(progress, timeout=1.0):
            pass
        kind, *rest = self._outcome
        if kind == "ok":
            self.cpu_s = rest[1]
            return rest[0]
        if kind == "died":
            code = rest[0]
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise ExportError(f"the {self.name} process ended without a result ({how}; out of memory?)")
        if kind == "oserror":  # the parent names the file as its own (the staging folder's is the bundle's)
            code, strerror, filename, child_traceback = rest
            error = OSError(code, strerror) if filename is None else OSError(code, strerror, filename)
            error.add_note(f"in the {self.name} process:\n{child_traceback}")
            raise error
        message, is_export_error, child_traceback = rest
        error = ExportError(message.split(": ", 1)[1] if is_export_error else f"{self.name} failed: {message}")
        error.add_note(f"in the {self.name} process:\n{child_traceback}")
        raise error

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._recv.close()


class Jobs:
    """The background jobs of one export, and the torch thread count of the parent meanwhile.

    A context manager: leaving it (normally, on an error or on an interrupt) stops every child that
    is still running, before the export's transaction removes its staging folder."""

    def __init__(self, report: Callable[[str, str], None] | None = None, progress: ProgressFn | None = None):
        self.report, self.progress = report, progress  # the pipeline's Reporter and progress callback
        self.threads = torch.get_num_threads()  # the parent's count with no child running
        self._jobs: dict[str, Job] = {}

    def __enter__(self) -> "Jobs":
        return self

    def __exit__(self, *exc) -> None:
        for job in self._jobs.values():
            job.stop()
        torch.set_num_threads(self.threads)

    def start(self, name: str, fn: Callable, *args, **kwargs) -> Job:
        assert name not in self._jobs or self._jobs[name].done, f"job {name} is already running"
        self._jobs[name] = job = Job(name, fn, args, kwargs)
        self._settle()
        return job

    def collect(self, name: str) -> Any:
        """Wait for job ``name`` (forwarding its progress) and return its result; the job's own times
        are reported once, as a "background" event."""
        job = self._jobs[name]
        try:
            result = job.result(self.progress)
        finally:
            self._settle()
        if self.report is not None and not job.reported:
            job.reported = True
            self.report("background", f"{name}: {job.elapsed_s:.1f} s wall, {job.cpu_s:.1f} s CPU")
        return result

    def poll(self) -> None:
        """Forward the children's progress; give the parent its threads back once they are done;
        raise a job's error at once (a trace that failed stops the export now, not when its graph
        is needed). Called between the parent's units of work (its own progress records)."""
        for name, job in self._jobs.items():
            if job.poll(self.progress) and job.failed:
                self.collect(name)  # raises
        self._settle()

    @property
    def running(self) -> int:
        return sum(not job.done for job in self._jobs.values())

    def cpu_threads(self) -> int:
        """Threads the parent should use now: one per core minus one per running child."""
        return max(1, self.threads - self.running)

    def _settle(self) -> None:
        torch.set_num_threads(self.cpu_threads())
