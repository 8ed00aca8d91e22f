"""What every export stage reads: the loaded checkpoint and the settings the stages need, built once
by the load stage and never changed afterwards. What a stage computes is returned to the pipeline, which
hands it to the stages that need it (:mod:`mbert.export.pipeline` reads as that flow)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mbert.bundle.pooling import PoolingConfig
from mbert.bundle.validation import Case
from mbert.export.background import Jobs
from mbert.export.progress import ProgressFn
from mbert.modeling.graph import GraphModule

# (event, message); events: "stage", "done", "started" (a stage that started a background job),
# "background" ("NAME: WALL s wall, CPU s CPU": that job's own times, once collected), "info", "warn", "progress"
Reporter = Callable[[str, str], None]


@dataclass(frozen=True)
class Context:
    """The loaded checkpoint, the settings the stages read, the validation grid, and where the eager
    work runs; frozen (stage results are returned, never set here)."""

    source: str
    target: Path  # where the bundle will be
    staging: Path  # where its files are written until the swap
    model: torch.nn.Module
    pooling: PoolingConfig | None
    tokenizer: object
    max_len: int
    opset: int  # --opset
    margin: float  # --margin: the FP16 headroom factor
    texts: tuple[str, ...]  # built-in texts plus the user's calibration file
    cases: tuple[Case, ...]  # the validation grid on real text
    device: torch.device  # where the eager passes run (--device)
    jobs: Jobs  # the traces running in a child process
    progress: ProgressFn | None  # progress records of long stages

    @property
    def graph(self) -> GraphModule:
        return GraphModule(self.model, self.pooling).eval()
