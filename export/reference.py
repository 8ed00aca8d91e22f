"""The eager reference outputs that validation compares every artifact with, computed once.

``compare`` (``mbert.bundle.validation``) calls its ``reference`` for every case; the FP32 graph,
the FP16 graph and the naive FP16 conversion are all judged against the same eager FP32 outputs,
so they are computed once per case (on ``--device``) and served from memory afterwards.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from mbert.export.device import fp32_reference, model_on, resolve_device
from mbert.export.progress import ProgressFn, case_progress

CACHE_BYTES = 1 << 30  # outputs kept in memory; beyond that a case is recomputed when asked for


class ReferenceOutputs:
    """``(ids, mask) -> {output name: array}`` of the eager graph module (``GraphModule``), cached.

    ``precompute(cases)`` runs every case once, reporting progress; later calls with the same ids
    and mask (any case object holding them) are served from the cache.
    """

    def __init__(self, graph_module: nn.Module, *, device: str | torch.device | None = None,
                 cache_bytes: int = CACHE_BYTES):
        where = resolve_device(device) if device is not None else next(graph_module.parameters()).device
        self.graph = model_on(graph_module, where).eval()
        self.device = where
        self.output_names = tuple(graph_module.output_names)
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple, dict[str, np.ndarray]] = {}
        self._bytes = 0
        self.computed = 0  # eager forwards run (cache misses)

    @staticmethod
    def _key(ids: np.ndarray, mask: np.ndarray) -> tuple:
        return ids.shape, ids.tobytes(), mask.tobytes()

    @torch.no_grad()
    def _run(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        with fp32_reference():
            out = self.graph(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
        out = out if isinstance(out, tuple) else (out,)
        self.computed += 1
        return {n: o.float().cpu().numpy() for n, o in zip(self.output_names, out)}

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        key = self._key(ids, mask)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        result = self._run(ids, mask)
        size = sum(a.nbytes for a in result.values())
        if self._bytes + size <= self.cache_bytes:
            self._cache[key] = result
            self._bytes += size
        return result

    def precompute(self, cases: Sequence, progress: ProgressFn | None = None) -> "ReferenceOutputs":
        """Run every case now (each ``case.input_ids``, ``case.attention_mask``), with progress."""
        on_case = case_progress("reference", self.graph.model.config, cases, progress)
        for case in cases:
            self(case.input_ids, case.attention_mask)
            if on_case is not None:
                on_case(case)
        return self
