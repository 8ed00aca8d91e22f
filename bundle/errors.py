"""One error hierarchy for mbert-export.

Every error a user can cause (bad checkpoint, bad config, bad bundle, failed parity) derives
from :class:`MbertError`; the CLIs print ``str(error)`` as one line and exit non-zero.
``assert`` is reserved for internal invariants.
"""
from __future__ import annotations


class MbertError(Exception):
    """Base class of every error mbert-export raises on purpose: bad input or environment.

    The command lines print ``str(error)`` as one line and exit with ``exit_code``: 1 for bad input
    or environment, 2 for a usage error (:class:`OptionError`); 3 is kept for internal errors."""

    exit_code = 1


class OptionError(MbertError, ValueError):
    """An option or argument value is out of its range (the message names the option)."""

    exit_code = 2


class ConfigError(MbertError):
    """A config.json value is missing or invalid (the message names the key and the file)."""


class CheckpointError(MbertError):
    """Weights are missing, unexpected, mis-shaped, or the file is corrupt."""


class PoolingError(MbertError):
    """A sentence-transformers pooling description cannot be honoured."""


class TokenizerError(MbertError):
    """A tokenizer file is missing or unreadable."""


class TextFileError(MbertError):
    """A user-supplied text (a calibration or input file, an argument) is unreadable or malformed."""


class ExportError(MbertError):
    """Tracing or writing an ONNX graph failed."""


class ValidationError(MbertError):
    """An exported artifact does not match the eager model within the stated tolerance."""


class PrecisionError(MbertError):
    """The FP16 scan or plan cannot be honoured."""


class EngineError(MbertError):
    """A TensorRT engine could not be built, loaded or run."""


class BundleError(MbertError):
    """A bundle folder is missing, incomplete, tampered with or built for another machine."""


class CorpusError(MbertError):
    """A corpus job's output folder cannot be used: not writable, holding other files, or made from
    another bundle, input or options (the message names what differs)."""


def failure(exc: BaseException) -> tuple[str, int]:
    """The one line a command line prints for ``exc``, and its exit code: the error's own for an
    :class:`MbertError` (1 bad input, 2 usage), 1 for the environment (a file or folder that cannot be
    read or written), 3 for anything else (a bug)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, MbertError):
        return f"error: {text}", exc.exit_code
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"error: {where}{exc.strerror or text}", 1
    return (f"internal error: {type(exc).__name__}: {text} (rerun with --debug for the traceback, and please "
            "report it)", 3)
