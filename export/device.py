"""Where the export's eager passes run (the FP16 scan, the reference outputs): ``--device``.

``auto`` is CUDA when torch sees a GPU, else the CPU. The FP32 reference stays FP32 on a GPU:
TF32 matmuls are switched off for the pass (``fp32_reference``), so a GPU reference is the same
function as a CPU one up to summation order. (Written for CUDA; not measured on a GPU here.)
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from mbert.bundle.errors import ExportError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``auto`` / None -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if isinstance(spec, torch.device):
        return spec
    if spec in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (isinstance(spec, str) and spec.startswith("cuda:")):
        if not torch.cuda.is_available():
            raise ExportError(f"--device {spec}: torch sees no CUDA GPU (torch {torch.__version__})")
        return torch.device(spec)
    raise ExportError(f"--device {spec!r}: choose one of {', '.join(DEVICES)}")


def model_on(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` itself when it already lives on ``device``, else a copy moved there (the caller's
    model is never moved: it is traced and saved from where it was loaded)."""
    if next(model.parameters()).device == device:
        return model
    return copy.deepcopy(model).to(device)  # buffers (the FP32 RoPE tables) move with it


@contextlib.contextmanager
def fp32_reference():
    """No TF32 in matmuls while an FP32 reference is computed (a no-op on the CPU)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
