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

from mbert.bundle.config import TASKS, ModernBertConfig
from mbert.bundle.errors import OptionError
from mbert.bundle.names import TRITON_ENCODERS
from mbert.export.fp16.precision import DEFAULT_MARGIN
from mbert.export.onnx.trace import MIN_OPSET, MIN_SEQ_LEN, OPSET


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
    workspace_gib: float | None = None  # None: TensorRT's own limit (why: mbert.export.tensorrt.build)
    engine: str = "auto"  # with --fp16: auto | tensorrt | tensorrt-rtx | none
    compute_capabilities: tuple[str, ...] | None = None  # TensorRT-RTX targets (default: its portable set)
    hardware_compatible: bool = False  # datacenter TensorRT: a plan for any Ampere or newer GPU
    triton_encoder: str = "python"  # what the Triton ensemble routes to: python, onnx or trt
    int8: bool = False  # also model.int8.onnx for CPU serving (export/int8_stage.py)
    device: str = "auto"  # the eager passes (scan, reference outputs): auto | cpu | cuda (mbert.export.device)

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
        if self.workspace_gib is not None and not (isinstance(self.workspace_gib, (int, float))
                                                   and math.isfinite(self.workspace_gib) and self.workspace_gib > 0):
            raise OptionError(f"--workspace-gib must be a positive number, got {self.workspace_gib!r}")
        self._check_engine()
        from mbert.export.device import DEVICES

        if self.device not in DEVICES:
            raise OptionError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
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
        if self.triton_encoder not in TRITON_ENCODERS:
            raise OptionError(f"--triton-encoder must be python, onnx or trt, got {self.triton_encoder!r}")
        if self.triton_encoder == "trt" and not (self.fp16 and self.family in ("auto", "tensorrt")):
            raise OptionError("--triton-encoder trt routes Triton to the TensorRT plan: it needs --fp16 and a datacenter "
                              "TensorRT engine (Triton cannot load TensorRT-RTX plans)")
        if not self.fp16 and any(v is not None for v in (self.opt_batch, self.opt_seq_len, self.split_seq)):
            raise OptionError("--opt-batch, --opt-seq-len and --split-seq shape the TensorRT engine: they apply "
                              "only with --fp16")

    def _check_engine(self) -> None:
        from mbert.runtime.backends.family import ENGINE_CHOICES, RTX_TARGETS

        if self.engine not in (*ENGINE_CHOICES, "none"):
            raise OptionError(f"--engine must be one of {', '.join(ENGINE_CHOICES)} or none, got {self.engine!r}")
        for cc in self.compute_capabilities or ():
            if cc not in RTX_TARGETS:
                raise OptionError(f"--compute-capability {cc}: TensorRT-RTX targets {', '.join(RTX_TARGETS)}; 9.0 and "
                                  "10.0 GPUs (H100, H200, B200) need datacenter TensorRT (--engine tensorrt, built on "
                                  "such a GPU)")
        if self.compute_capabilities is not None and not self.compute_capabilities:
            raise OptionError("--compute-capability needs at least one capability, e.g. 8.6,8.9,12.0")
        if self.compute_capabilities and self.engine in ("tensorrt", "none"):
            raise OptionError(f"--compute-capability targets TensorRT-RTX; it does not apply with --engine {self.engine}")
        if self.hardware_compatible and self.engine in ("tensorrt-rtx", "none"):
            raise OptionError(f"--hardware-compatible is a datacenter TensorRT option; it does not apply with "
                              f"--engine {self.engine}")
        if self.compute_capabilities and self.hardware_compatible:
            raise OptionError("--compute-capability (TensorRT-RTX) and --hardware-compatible (datacenter TensorRT) "
                              "exclude each other")
        if not self.fp16 and (self.engine in ("tensorrt", "tensorrt-rtx") or self.compute_capabilities
                              or self.hardware_compatible):
            raise OptionError("--engine, --compute-capability and --hardware-compatible build the TensorRT engine: "
                              "they apply only with --fp16")

    @property
    def family(self) -> str:
        """The family to build with: ``engine``, where ``auto`` with TensorRT-RTX targets means TensorRT-RTX
        and ``auto`` with --hardware-compatible means datacenter TensorRT."""
        if self.engine == "auto" and self.compute_capabilities:
            return "tensorrt-rtx"
        if self.engine == "auto" and self.hardware_compatible:
            return "tensorrt"
        return self.engine

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
