"""The two TensorRT families this project builds and runs engines with, and what is installed here.

* ``tensorrt``: NVIDIA TensorRT 10.12+ / 11.x (module ``tensorrt``), for datacenter and any GPU it
  supports. Its builder needs a CUDA GPU, and a plan runs only on the TensorRT version and compute
  capability that built it (unless built hardware-compatible: then on any Ampere or newer GPU).
* ``tensorrt-rtx``: NVIDIA TensorRT for RTX 1.x (module ``tensorrt_rtx``, ``pip install
  tensorrt-rtx-cu12``). Its builder needs no GPU (ahead-of-time build), a plan runs on the compute
  capabilities it was built for (7.5, 8.0, 8.6, 8.9, 12.0, 12.1; no 9.0 / 10.0: H100, H200 and B200
  need datacenter TensorRT) and only with the TensorRT-RTX release that built it.

Both import lazily: nothing here imports ``tensorrt``/``tensorrt_rtx`` until a function needs it,
so ``--help`` stays instant. Each family gets one process-wide logger: TensorRT keeps
the first logger registered by a live builder or runtime and ignores later ones ("The logger
passed into createInferRuntime differs from one already registered", measured with TensorRT-RTX
1.7), so every builder, parser and runtime of a family shares one logger (:func:`family_logger`), and
a build captures its messages through its ``capture`` context.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from mbert.bundle.engine import FAMILIES, LABELS
from mbert.bundle.errors import EngineError

__all__ = [
    "FAMILIES", "ENGINE_CHOICES", "MODULES", "EXTRAS", "RTX_TARGETS", "PORTABLE_CAPABILITIES", "Availability",
    "version_problem", "import_family", "builder_available", "runtime_version", "resolve_family",
    "family_logger", "one_line",
]

ENGINE_CHOICES = ("auto", *FAMILIES)
MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
EXTRAS = {"tensorrt": "pip install 'mbert-export[tensorrt]'; its builder needs a CUDA GPU",
          "tensorrt-rtx": "pip install 'mbert-export[tensorrt-rtx]'"}
# The compute capabilities TensorRT-RTX 1.7 can target (its ComputeCapability enum: SM75 ... SM121;
# no 9.0 / 10.0: H100, H200 and B200 need datacenter TensorRT), and its default portable set ("By
# default, an engine built by TensorRT-RTX can be run on GPU devices with compute capability 8.0,
# 8.6, 8.9, 12.0": TensorRT-RTX docs, CPU-only AOT). This project asks for targets explicitly, so
# the record lists exactly what the plan was built for.
RTX_TARGETS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")
PORTABLE_CAPABILITIES = ("8.0", "8.6", "8.9", "12.0")
# (lowest, first unsupported) version per family. tensorrt: 10.12 is the first release where
# strongly typed networks carry FP16 without the deprecated builder flags; 12.x is unknown (11.x
# removed APIs, a new major may again). tensorrt_rtx: 1.7 is the release this project is tested
# with (compute-capability targets, get_engine_validity); earlier 1.x releases are unverified.
VERSION_RANGES = {"tensorrt": ((10, 12), (12, 0)), "tensorrt-rtx": ((1, 7), (2, 0))}
# ILogger.Severity (same in both families): INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4.
_PY_LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG}

_log = logging.getLogger("mbert.tensorrt")


def one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _check_family(family: str) -> str:
    if family not in FAMILIES:
        raise EngineError(f"unknown TensorRT family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family


def version_problem(family: str, version: str) -> str | None:
    """Why ``version`` of ``family`` is not supported, or None when it is (pure; no import)."""
    _check_family(family)
    m = re.match(r"^(\d+)\.(\d+)", str(version))
    if not m:
        return f"unrecognised {LABELS[family]} version {version!r}"
    got = (int(m.group(1)), int(m.group(2)))
    (lo, hi) = VERSION_RANGES[family]
    if got < lo:
        return f"{LABELS[family]} {version} is too old: {lo[0]}.{lo[1]} or newer is required"
    if got >= hi:
        return (f"{LABELS[family]} {version} is newer than this project supports (below {hi[0]}.{hi[1]}); "
                "its API may have changed")
    return None


def import_family(family: str) -> Any:
    """The family's module, version-checked; EngineError with a one-line reason otherwise."""
    _check_family(family)
    name = MODULES[family]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        raise EngineError(f"{name} is not installed ({EXTRAS[family]})") from None
    except (ImportError, OSError) as exc:  # wheel present, its shared libraries missing or broken
        raise EngineError(f"{name} is installed but cannot be imported ({EXTRAS[family]}): {one_line(exc)}") \
            from exc
    problem = version_problem(family, str(getattr(module, "__version__", "")))
    if problem:
        raise EngineError(problem)
    return module


@dataclass(frozen=True)
class Availability:
    """Whether a family's builder (or runtime) can be used here, its version, and why not."""

    family: str
    ok: bool
    version: str = ""
    reason: str = ""

    def __str__(self) -> str:
        label = LABELS[self.family]
        return f"{label} {self.version}" if self.ok else f"{label}: {self.reason}"


def runtime_version(family: str) -> Availability:
    """The family's version when its module imports and passes the version gate (no GPU probed)."""
    try:
        module = import_family(family)
    except EngineError as exc:
        return Availability(family, False, reason=str(exc))
    return Availability(family, True, str(module.__version__))


def builder_available(family: str) -> Availability:
    """Whether an engine can be *built* here. TensorRT-RTX builds without a GPU; datacenter
    TensorRT's builder fails to start without one ("CUDA initialization failure")."""
    found = runtime_version(family)
    if not found.ok:
        return found
    trt = importlib.import_module(MODULES[family])
    try:
        builder = trt.Builder(family_logger(trt))
    except Exception as exc:  # noqa: BLE001 - CUDA initialisation failures surface as various types
        return Availability(family, False, found.version, f"the {LABELS[family]} builder cannot start "
                            f"(no CUDA GPU?): {one_line(exc)}")
    if builder is None:
        return Availability(family, False, found.version,
                            f"the {LABELS[family]} builder cannot start (no CUDA GPU?)")
    return found


def resolve_family(requested: str) -> Availability:
    """The family ``requested`` names, or for ``auto`` the first whose builder starts here: datacenter
    TensorRT first (the only one for 9.0 / 10.0 GPUs, and it builds for the GPU it runs on), then
    TensorRT-RTX. EngineError with every family's reason when none can build."""
    if requested not in ENGINE_CHOICES:
        raise EngineError(f"--engine must be one of {', '.join(ENGINE_CHOICES)} or none, got {requested!r}")
    candidates = FAMILIES if requested == "auto" else (requested,)
    found = [builder_available(f) for f in candidates]
    for availability in found:
        if availability.ok:
            return availability
    raise EngineError("no TensorRT builder can run here: " + "; ".join(str(a) for a in found))


def _make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` (see :func:`family_logger`) with ``errors`` and ``capture``."""

    class TrtLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self._sinks: list[tuple[int, list[tuple[int, str]]]] = []
            self._lock = threading.Lock()

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            with self._lock:
                if level <= 1:
                    self.errors = (self.errors + [one_line(msg)])[-200:]
                for threshold, sink in self._sinks:
                    if level <= threshold:
                        sink.append((level, str(msg)))
            if level <= 2:
                _log.log(_PY_LEVELS[level], "%s: %s", trt.__name__, msg)

        @contextlib.contextmanager
        def capture(self, severity: int = 4) -> Iterator[list[tuple[int, str]]]:
            """Collect ``(severity, message)`` of every message at or above ``severity`` (0 = worst)."""
            sink: list[tuple[int, str]] = []
            entry = (int(severity), sink)
            with self._lock:
                self._sinks.append(entry)
            try:
                yield sink
            finally:
                with self._lock:
                    self._sinks.remove(entry)

    return TrtLogger()


_LOGGERS: dict[str, Any] = {}
_LOGGERS_LOCK = threading.Lock()


def family_logger(trt: Any) -> Any:
    """The one ``ILogger`` of the module ``trt`` (``tensorrt`` or ``tensorrt_rtx``) in this process.

    Messages of severity WARNING or worse go to Python logging (``mbert.tensorrt``); ERROR and
    INTERNAL_ERROR messages are kept in ``.errors`` (the last 200); ``with logger.capture(4) as
    lines:`` collects every message at or above a severity while the block is open.
    """
    with _LOGGERS_LOCK:
        if trt.__name__ not in _LOGGERS:
            _LOGGERS[trt.__name__] = _make_logger(trt)
        return _LOGGERS[trt.__name__]
