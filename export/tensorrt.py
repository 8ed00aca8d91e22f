"""TensorRT for mbert-export: where the pieces live, and the names the pipeline used before them.

The engine code is split by what it needs:

==========================================  =====================================================
``mbert.runtime.trt_family``                families (``tensorrt`` 10.12+/11.x, ``tensorrt_rtx``
                                            1.7+), version gates, ``builder_available``,
                                            ``resolve_family("auto")``, the shared logger, the GPU
``mbert.runtime.trt_profiles``              ``Profile``, ``profiles_from``, ``select_profile``
``mbert.runtime.trt_record``                ``EngineRecord`` (the manifest's engine record)
``mbert.runtime.trt_compat``                ``engine_compatibility``, ``can_run``, TensorRT-RTX's
                                            ``get_engine_validity``
``mbert.runtime.trt_runner``                deserialize and execute (GPU only)
``mbert.export.trt_build``                  ``build_engine`` for both families, the build log,
                                            ``tensorrt_verdict`` (the naive FP16 comparison)
``mbert.export.trt_precision``              the precision walk over TensorRT's parsed network
==========================================  =====================================================

The functions below keep the pipeline's previous calls working unchanged until it is rewired to
the family-aware API (``tensorrt_available`` and ``build_engine`` here mean datacenter TensorRT on
a CUDA GPU, returning the previous manifest dict). Nothing here imports TensorRT at import time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from mbert.runtime.trt_family import builder_available
from mbert.runtime.trt_profiles import Profile, profiles_from, select_profile
from mbert.runtime.trt_runner import LoadedEngine, TensorRTRunner, load_engine

__all__ = [
    "Profile", "profiles_from", "select_profile", "tensorrt_available", "build_engine",
    "load_engine", "LoadedEngine", "TensorRTRunner",
]


def tensorrt_available() -> tuple[bool, str]:
    """``(True, "")`` when datacenter TensorRT imports and its builder starts (a CUDA GPU is
    present), else ``(False, one-line reason)``. TensorRT-RTX is not considered here: see
    :func:`mbert.runtime.trt_family.builder_available`."""
    found = builder_available("tensorrt")
    return found.ok, found.reason


def build_engine(onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile], *,
                 workspace_gib: float = 4.0, timing_cache_path: str | Path | None = None,
                 builder_optimization_level: int = 3) -> dict[str, Any]:
    """Datacenter TensorRT build with the previous manifest dict as result (see the module docstring)."""
    from .trt_build import build_engine as build  # noqa: PLC0415

    record = build(onnx_path, plan_path, profiles, family="tensorrt", workspace_gib=workspace_gib,
                   optimization_level=builder_optimization_level, timing_cache_path=timing_cache_path)
    assert record.built_on is not None  # datacenter records always name their GPU
    return {
        "tensorrt_version": record.version, "gpu_name": record.built_on.name,
        "compute_capability": record.built_on.compute_capability,
        "profiles": [p.as_lists() for p in record.profiles], "workspace_gib": record.options.workspace_gib,
        "builder_optimization_level": record.options.optimization_level, "build_seconds": record.build_seconds,
        "onnx": record.onnx, "plan": record.plan, "strongly_typed": record.options.strongly_typed,
    }
