"""The export's options, checked before any work starts.

:meth:`ExportOptions.check` rejects every value that is out of range on its own (an
:class:`OptionError` naming the option: the command line exits 2); :meth:`ExportOptions.check_for`
rejects what is out of range for the checkpoint (``--max-seq-len`` against its
``max_position_embeddings``) as soon as its config.json is read, before the weights load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mbert.modeling.config import TASKS, ModernBertConfig
from mbert.modeling.errors import OptionError

from .onnx import MIN_OPSET, MIN_SEQ_LEN, OPSET
from .precision import DEFAULT_MARGIN


@dataclass(frozen=True)
class ExportOptions:
    out: Path | None = None  # default: engines/<model-name>
    max_seq_len: int | None = None  # default: sentence-transformers' max_seq_length, else max positions
    opset: int = OPSET
    overwrite: bool = False
    task: str | None = None  # override the head config.json's architectures selects
    fp16: bool = False
    calibration: Path | None = None  # the user's texts, added to the built-in set
    margin: float = DEFAULT_MARGIN
    max_batch: int = 32
    opt_batch: int | None = None
    opt_seq_len: int | None = None
    split_seq: tuple[int, ...] | None = None
    workspace_gib: float = 4.0
    engine: bool = True  # try TensorRT when --fp16

    def target(self, source: str | Path) -> Path:
        """The bundle folder: ``out``, else ``engines/<last part of source>``."""
        if self.out is not None:
            return Path(self.out)
        return Path("engines") / (Path(str(source).rstrip("/")).name or "model")

    def check(self) -> None:
        """OptionError naming the first option whose value cannot work, whatever the checkpoint."""
        def positive_int(name: str, value, minimum: int = 1) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise OptionError(f"--{name} must be an integer >= {minimum}, got {value!r}")

        positive_int("max-seq-len", self.max_seq_len, MIN_SEQ_LEN)
        positive_int("opset", self.opset, MIN_OPSET)
        positive_int("max-batch", self.max_batch)
        positive_int("opt-batch", self.opt_batch)
        positive_int("opt-seq-len", self.opt_seq_len)
        if self.task is not None and self.task not in TASKS:
            raise OptionError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 1):
            raise OptionError(f"--margin must be a finite number >= 1 (the FP16 headroom factor), got {self.margin!r}")
        if not (isinstance(self.workspace_gib, (int, float)) and math.isfinite(self.workspace_gib)
                and self.workspace_gib > 0):
            raise OptionError(f"--workspace-gib must be a positive number, got {self.workspace_gib!r}")
        if self.opt_batch is not None and self.opt_batch > self.max_batch:
            raise OptionError(f"--opt-batch {self.opt_batch} exceeds --max-batch {self.max_batch}")
        if self.max_seq_len is not None and self.opt_seq_len is not None and self.opt_seq_len > self.max_seq_len:
            raise OptionError(f"--opt-seq-len {self.opt_seq_len} exceeds --max-seq-len {self.max_seq_len}")
        if self.split_seq is not None:
            for v in self.split_seq:
                positive_int("split-seq", v)
            if list(self.split_seq) != sorted(set(self.split_seq)):
                raise OptionError(f"--split-seq must be strictly increasing, got {','.join(map(str, self.split_seq))}")
            if self.max_seq_len is not None and self.split_seq[-1] > self.max_seq_len:
                raise OptionError(f"--split-seq {self.split_seq[-1]} exceeds --max-seq-len {self.max_seq_len}")
        if not self.fp16 and any(v is not None for v in (self.opt_batch, self.opt_seq_len, self.split_seq)):
            raise OptionError("--opt-batch, --opt-seq-len and --split-seq shape the TensorRT engine: they apply "
                              "only with --fp16")

    def max_len_for(self, cfg: ModernBertConfig, pooling_max: int | None) -> int:
        """The bundle's max sequence length for this checkpoint; OptionError when out of its range."""
        max_len = self.max_seq_len if self.max_seq_len is not None else (pooling_max or cfg.max_position_embeddings)
        if not MIN_SEQ_LEN <= max_len <= cfg.max_position_embeddings:
            raise OptionError(f"--max-seq-len {max_len} is outside {MIN_SEQ_LEN}..{cfg.max_position_embeddings} "
                              f"(max_position_embeddings of {cfg.source}; {MIN_SEQ_LEN} is the smallest length the "
                              "tracer keeps dynamic)")
        for name, value in (("opt-seq-len", self.opt_seq_len),
                            ("split-seq", self.split_seq[-1] if self.split_seq else None)):
            if value is not None and value > max_len:
                raise OptionError(f"--{name} {value} exceeds the bundle's max sequence length {max_len}")
        return max_len
