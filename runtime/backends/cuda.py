"""CUDA through cuda-python's *driver* API (``cuda.bindings.driver``): which GPU is here, and the
device memory, copies and stream a TensorRT plan runs with. The driver API needs only the NVIDIA
driver (no CUDA toolkit, no torch), so a serving install carries no training framework. Nothing
here runs on the build machines (no GPU): ``current_gpu`` answers None there, which the tests check.
"""
from __future__ import annotations

import importlib
from typing import Any

from mbert.bundle.engine import Gpu
from mbert.bundle.errors import EngineError
from mbert.runtime.backends.family import one_line


def driver() -> Any:
    """cuda-python's driver API module; EngineError naming the extra when it is missing."""
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise EngineError("running a TensorRT plan needs cuda-python (pip install 'mbert-export[tensorrt]' or "
                      "'[tensorrt-rtx]')")


def check(result: Any, what: str) -> Any:
    """The value(s) of a driver call ``(CUresult, *values)``; EngineError on an error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise EngineError(f"CUDA driver: {what} failed ({name})")
    return values[0] if len(values) == 1 else values


class CudaDevice:
    """A GPU's primary context (shared with TensorRT and any CUDA runtime user), one stream, and
    named device buffers that grow to the largest request seen."""

    def __init__(self, device: int = 0) -> None:
        cu = self.cu = driver()
        try:
            check(cu.cuInit(0), "cuInit")
        except Exception as exc:  # noqa: BLE001 - no driver library, or no device: the same answer
            raise EngineError(f"TensorRTRunner needs a visible CUDA GPU and its driver ({one_line(exc)})") from exc
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if device >= count:
            raise EngineError(f"CUDA device {device} does not exist ({count} visible)")
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self._stream = check(cu.cuStreamCreate(0), "cuStreamCreate")
        self._buffers: dict[str, tuple[Any, int]] = {}

    @property
    def stream(self) -> int:
        return int(self._stream)

    def make_current(self) -> None:
        check(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def buffer(self, name: str, nbytes: int) -> int:
        """The device address of buffer ``name``, (re)allocated to hold at least ``nbytes``."""
        ptr, size = self._buffers.get(name, (None, 0))
        if ptr is None or size < nbytes:
            if ptr is not None:
                check(self.cu.cuMemFree(ptr), "cuMemFree")
            ptr = check(self.cu.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes}) for {name}")
            self._buffers[name] = (ptr, max(nbytes, 1))
        return int(ptr)

    def upload(self, name: str, array: Any) -> int:
        address = self.buffer(name, array.nbytes)
        check(self.cu.cuMemcpyHtoDAsync(address, array.ctypes.data, array.nbytes, self._stream), f"copy {name} in")
        return address

    def download(self, name: str, array: Any) -> None:
        ptr, _ = self._buffers[name]
        check(self.cu.cuMemcpyDtoHAsync(array.ctypes.data, ptr, array.nbytes, self._stream), f"copy {name} out")

    def synchronize(self) -> None:
        check(self.cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def __del__(self) -> None:
        cu = getattr(self, "cu", None)
        for ptr, _ in getattr(self, "_buffers", {}).values():
            cu.cuMemFree(ptr)
        if getattr(self, "_stream", None) is not None:
            cu.cuStreamDestroy(self._stream)
        if getattr(self, "context", None) is not None:
            cu.cuDevicePrimaryCtxRelease(self.device)


def current_gpu(device: int = 0) -> Gpu | None:
    """The CUDA GPU ``device`` (its name and compute capability), or None when there is none, or no
    driver, or no cuda-python."""
    try:
        cu = driver()
        check(cu.cuInit(0), "cuInit")
        if device >= check(cu.cuDeviceGetCount(), "cuDeviceGetCount"):
            return None
        handle = check(cu.cuDeviceGet(device), "cuDeviceGet")
        name = check(cu.cuDeviceGetName(256, handle), "cuDeviceGetName")
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle), "major")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle), "minor")
    except Exception:  # noqa: BLE001 - absent or unusable: no GPU here
        return None
    text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    return Gpu(text.split("\x00", 1)[0].strip(), f"{major}.{minor}")
