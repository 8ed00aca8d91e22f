"""Optimization profiles of a TensorRT engine: the (batch, sequence) ranges it accepts.

Pure Python (no TensorRT import): the export side builds engines with them, the runtime picks the
profile for an input shape, and the engine record stores them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from mbert.modeling.errors import EngineError

__all__ = ["Profile", "profiles_from", "select_profile"]

# Typical retrieval / classification inputs are at most this long (see profiles_from).
_SHORT_TEXT = 512


@dataclass(frozen=True)
class Profile:
    """One optimization profile: (batch, sequence) shapes for every network input."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            value = getattr(self, name)
            try:
                if isinstance(value, (str, bytes)) or len(value) != 2 \
                        or any(isinstance(v, bool) for v in value):
                    raise TypeError
                pair = (operator.index(value[0]), operator.index(value[1]))
            except TypeError:
                raise EngineError(f"profile {name} must be a (batch, sequence) pair of ints, "
                                  f"got {value!r}") from None
            object.__setattr__(self, name, pair)
        for axis, label in ((0, "batch"), (1, "sequence")):
            lo, mid, hi = self.min[axis], self.opt[axis], self.max[axis]
            if not 1 <= lo <= mid <= hi:
                raise EngineError(f"profile {label} sizes must satisfy 1 <= min <= opt <= max, "
                                  f"got min={lo} opt={mid} max={hi}")

    def covers(self, batch: int, seq: int) -> bool:
        """True when a (batch, seq) input lies inside this profile's range."""
        return (self.min[0] <= batch <= self.max[0]) and (self.min[1] <= seq <= self.max[1])

    def as_lists(self) -> dict[str, list[int]]:
        """JSON form used in manifests: ``{"min": [b, s], "opt": [...], "max": [...]}``."""
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    @classmethod
    def from_any(cls, value: "Profile | dict[str, Sequence[int]]") -> "Profile":
        """Accept a Profile or its ``as_lists()`` form (as read back from a manifest)."""
        if isinstance(value, Profile):
            return value
        try:
            return cls(tuple(value["min"]), tuple(value["opt"]), tuple(value["max"]))
        except (KeyError, TypeError) as exc:
            raise EngineError(f"not an optimization profile: {value!r}") from exc

    def __str__(self) -> str:
        return f"min={self.min} opt={self.opt} max={self.max}"


def profiles_from(max_batch: int, max_seq_len: int, opt_batch: int | None = None,
                  opt_seq_len: int | None = None,
                  split_seq: list[int] | None = None) -> list[Profile]:
    """Optimization profiles covering batch 1..max_batch and sequence 1..max_seq_len.

    One profile by default. ``split_seq`` (e.g. ``[512, 8192]``) gives one profile per contiguous
    sequence range (1..512, 513..8192): each is tuned separately, so short requests get kernels
    chosen for short shapes instead of ones timed on long sequences. A last boundary below
    ``max_seq_len`` is extended with ``max_seq_len``.

    Defaults for the shape TensorRT times kernels at (``opt``; every shape in range still runs):

    * batch: ``max(1, max_batch // 2)``. Under load Triton's dynamic batcher fills batches, at low
      load they are small; the midpoint keeps tactics reasonable for both ends.
    * sequence: 512 (typical passage / query length, the length most retrieval and
      classification traffic stays under) when the range reaches down to it, clamped to the range;
      a range wholly above 512 (the long profile of a split) is tuned at its midpoint.
    ``opt_seq_len`` when given is clamped into every range.
    """
    for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(f"{name} must be a positive int, got {value!r}")
    if opt_batch is None:
        opt_batch = max(1, max_batch // 2)
    if not 1 <= opt_batch <= max_batch:
        raise EngineError(f"opt_batch must be in 1..{max_batch}, got {opt_batch}")
    if opt_seq_len is not None and not 1 <= opt_seq_len <= max_seq_len:
        raise EngineError(f"opt_seq_len must be in 1..{max_seq_len}, got {opt_seq_len}")
    bounds = sorted(set(split_seq or []))
    if split_seq and (list(split_seq) != bounds or bounds[0] < 1):
        raise EngineError(f"split_seq must be strictly increasing positive ints, got {split_seq}")
    if bounds and bounds[-1] > max_seq_len:
        raise EngineError(f"split_seq {split_seq} goes beyond max_seq_len {max_seq_len}")
    if not bounds or bounds[-1] < max_seq_len:
        bounds.append(max_seq_len)
    profiles, lo = [], 1
    for hi in bounds:
        if opt_seq_len is not None:
            opt_seq = min(max(opt_seq_len, lo), hi)
        elif lo <= _SHORT_TEXT:
            opt_seq = min(hi, _SHORT_TEXT)
        else:
            opt_seq = max(lo, hi // 2)
        profiles.append(Profile((1, lo), (opt_batch, opt_seq), (max_batch, hi)))
        lo = hi + 1
    return profiles


def select_profile(profiles: Sequence[Profile], batch: int, seq: int) -> int:
    """Index of the first profile whose range contains (batch, seq); EngineError if none does."""
    for index, profile in enumerate(profiles):
        if profile.covers(batch, seq):
            return index
    listed = "; ".join(f"#{i}: {p}" for i, p in enumerate(profiles)) or "none"
    raise EngineError(f"no optimization profile covers input shape (batch={batch}, seq={seq}); "
                      f"the engine's profiles are {listed}")
