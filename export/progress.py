"""Progress of long export stages: a callback receives frozen ``Progress`` records.

A stage reports each step it finishes with the work done so far, in the stage's own unit of work
(the scan counts estimated FLOPs, so its ETA holds when one long text dominates the set). The CLI
prints them; tests collect them. ``None`` means nobody listens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Progress:
    stage: str  # "trace", "scan", "reference", ...
    step: str  # the step just finished, e.g. "text 3/24 (825 tokens)"
    done: float  # work done so far, in the stage's unit
    total: float  # all the stage's work, same unit (0 when unknown)
    elapsed_s: float
    eta_s: Optional[float]  # None until there is something to extrapolate from

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total > 0 else 0.0

    def line(self) -> str:
        eta = f", about {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        pct = f" {100 * self.fraction:.0f}%" if self.total > 0 else ""
        return f"{self.stage}:{pct} {self.step} ({self.elapsed_s:.0f} s{eta})"


ProgressFn = Callable[[Progress], None]


class Meter:
    """Counts work for one stage and reports it; the ETA extrapolates the rate so far."""

    def __init__(self, stage: str, total: float, callback: Optional[ProgressFn]):
        self.stage, self.total, self.callback = stage, float(total), callback
        self.done = 0.0
        self.t0 = time.perf_counter()

    def advance(self, amount: float, step: str) -> None:
        self.done += amount
        if self.callback is None:
            return
        elapsed = time.perf_counter() - self.t0
        eta = None
        if self.total > 0 and 0 < self.done < self.total:
            eta = elapsed * (self.total - self.done) / self.done
        elif self.total > 0 and self.done >= self.total:
            eta = 0.0
        self.callback(Progress(self.stage, step, self.done, self.total, elapsed, eta))


def forward_flops(config, length: int, batch: int = 1) -> float:
    """Estimated FLOPs of one encoder forward (the progress unit of eager passes): the matrices
    (linear in the length), attention scores and values (quadratic in global layers, linear in local
    ones). Only ratios matter: it turns per-text progress into an ETA that one long text cannot fool."""
    d, inter, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    n_global = sum(config.is_global(i) for i in range(n))
    matrices = 2 * n * (4 * d * d + 3 * d * inter)
    attention = 4 * d * (n_global * length + (n - n_global) * 3 * config.window_half_width)
    return float(batch * length * (matrices + attention))


def case_progress(stage: str, config, cases, progress: Optional[ProgressFn]):
    """``on_case`` for ``mbert.bundle.validation.compare``: progress per judged case, weighted by
    the case's forward FLOPs (so the heavily padded and long cases move the ETA as they cost)."""
    if progress is None:
        return None
    costs = {id(c): forward_flops(config, c.input_ids.shape[1], c.input_ids.shape[0]) for c in cases}
    meter = Meter(stage, sum(costs.values()), progress)
    judged = []

    def on_case(case) -> None:
        judged.append(case)
        meter.advance(costs.get(id(case), 0.0), f"case {len(judged)}/{len(cases)} ({case.name})")

    return on_case
