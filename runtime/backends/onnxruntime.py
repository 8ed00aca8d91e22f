"""ONNX Runtime: the sessions every bundle graph runs in (the runtime, the export's validation, the
benchmarks' "ours"), with one set of session options."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from mbert.bundle.errors import BundleError
from mbert.bundle.files import check_regular
from mbert.bundle.tensors import Runner
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.text import Padding


def session_options(threads: int | None = None):
    """The ONNX Runtime session options of every session this project opens on a bundle graph (the
    runtime, the export's validation, the benchmarks' "ours").

    Memory-pattern planning is off. With it on, ONNX Runtime plans one block for all of a run's
    intermediates after the first run of a shape and keeps it next to its arena: at 1 x 8192 on
    full-size ModernBERT-base that took the peak RSS of a warm session from 1.85 to 2.98 GiB, at the
    same latency. What it buys is at small repeated shapes: 4 x 512 ran 4.09 s with it and 4.24 s
    without (median of 7 interleaved runs, same minimum); a server, which sees other shapes on most
    calls, gets less of it (README, "Measured").
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.enable_mem_pattern = False
    if threads:
        opts.intra_op_num_threads = threads
    return opts


class OrtBackend(Padding):
    def __init__(self, path: Path, max_seq: int, *, cuda: bool, precision: str, threads: int | None = None,
                 device_id: int = 0):
        import onnxruntime as ort

        check_regular(path, BundleError)  # ONNX Runtime would block on a FIFO
        opts = session_options(threads)
        providers: list = [("CUDAExecutionProvider", {"device_id": device_id})] if cuda else []
        providers.append("CPUExecutionProvider")
        self.session = ort.InferenceSession(str(path), opts, providers=providers)
        on_cuda = self.session.get_providers()[0] == "CUDAExecutionProvider"
        if cuda and not on_cuda:
            raise BundleError(f"ONNX Runtime could not use CUDA for {path.name} (no usable GPU?)")
        self.name = "onnxruntime-cuda" if on_cuda else "onnxruntime-cpu"
        self.precision, self.artifact, self.max_seq = precision, path.name, max_seq
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, input_ids, attention_mask, outputs=None):
        names = list(outputs) if outputs else self.output_names
        got = self.session.run(names, {"input_ids": input_ids, "attention_mask": attention_mask})
        return dict(zip(names, got))




def onnx_runner(path: Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None) -> Runner:
    """``path`` on ONNX Runtime (CPU by default) as a :data:`~mbert.bundle.tensors.Runner`."""
    import onnxruntime as ort

    check_regular(path, BundleError)
    session = ort.InferenceSession(str(path), session_options(threads), providers=list(providers))
    names = [o.name for o in session.get_outputs()]

    def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"input_ids": ids, "attention_mask": mask})))

    return run


def cuda_available() -> tuple[bool, str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return False, "onnxruntime is not installed (pip install 'mbert-export[cpu]' or '[gpu]')"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    if current_gpu() is None:
        return False, "no CUDA GPU visible"
    return True, ""
