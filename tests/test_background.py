"""The export's background jobs (``mbert.export.background``): a trace in a forked child process.

Each test runs a real child process; the functions it runs stand in for the trace only in what
they return or how they fail (the traces themselves run in every export test)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mbert.bundle.errors import ExportError
from mbert.export.background import Jobs
from mbert.export.progress import Meter


def _steps(n: int, progress=None) -> dict:
    meter = Meter("trace", n, progress)
    for i in range(n):
        meter.advance(1, f"step {i + 1}/{n}")
    return {"pid": os.getpid(), "threads": torch.get_num_threads()}


def _raises_export_error(progress=None):
    raise ExportError("tracing model to ONNX (onnxruntime) failed: Unsupported: an op")


def _raises_value_error(progress=None):
    raise ValueError("a bug in the child")


def _dies(progress=None):
    os.kill(os.getpid(), signal.SIGKILL)


def _sleeps(path, progress=None):
    path.write_text(str(os.getpid()))
    time.sleep(60)


def test_the_result_and_the_progress_come_back_from_a_child_with_one_thread():
    seen, reports = [], []
    with Jobs(lambda e, m: reports.append((e, m)), seen.append) as jobs:
        jobs.start("trace", _steps, 3)
        result = jobs.collect("trace")
        assert jobs.collect("trace") == result  # collected twice: same result, reported once
    assert result["pid"] != os.getpid() and result["threads"] == 1
    assert [p.step for p in seen] == ["step 1/3", "step 2/3", "step 3/3"] and {p.stage for p in seen} == {"trace"}
    assert len(reports) == 1 and reports[0][0] == "background" and reports[0][1].startswith("trace: ")


def test_the_parent_gives_a_thread_to_the_child_and_gets_it_back(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Jobs() as jobs:
            jobs.start("trace", _steps, 1)
            assert torch.get_num_threads() == 1 and jobs.cpu_threads() == 1
            jobs.collect("trace")
            assert torch.get_num_threads() == 2 and jobs.cpu_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_export_error_in_the_child_is_raised_in_the_parent_with_its_message():
    with Jobs() as jobs:
        jobs.start("trace", _raises_export_error)
        with pytest.raises(ExportError) as info:
            jobs.collect("trace")
    assert str(info.value) == "tracing model to ONNX (onnxruntime) failed: Unsupported: an op"
    assert any("_raises_export_error" in note for note in info.value.__notes__)  # the child's traceback


def test_any_other_error_in_the_child_names_the_job_and_keeps_the_traceback():
    with Jobs() as jobs:
        jobs.start("mixed precision", _raises_value_error)
        with pytest.raises(ExportError) as info:
            jobs.collect("mixed precision")
    assert str(info.value) == "mixed precision failed: ValueError: a bug in the child"  # the notes are apart
    assert any("ValueError" in note for note in info.value.__notes__)


def test_a_child_killed_without_a_result_is_an_error_not_a_hang():
    with Jobs() as jobs:
        jobs.start("trace", _dies)
        with pytest.raises(ExportError, match="ended without a result .killed by signal 9"):
            jobs.collect("trace")


def test_leaving_the_jobs_stops_a_child_that_is_still_running(tmp_path):
    marker = tmp_path / "pid"
    with pytest.raises(KeyboardInterrupt):
        with Jobs() as jobs:
            jobs.start("trace", _sleeps, marker)
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise KeyboardInterrupt  # what Ctrl-C or SIGTERM (sigterm_as_interrupt) raises in the export
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: no such process


def test_a_failed_job_stops_the_parent_at_its_next_unit_of_work():
    with Jobs() as jobs:
        jobs.start("trace", _raises_export_error)
        deadline = time.monotonic() + 60
        with pytest.raises(ExportError, match="Unsupported: an op"):
            while time.monotonic() < deadline:  # the parent's eager work, between whose steps it polls
                jobs.poll()
                time.sleep(0.05)
