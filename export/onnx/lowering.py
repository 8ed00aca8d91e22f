"""How ``mbert::attention`` (``mbert.modeling.model.attention``) becomes ONNX, per target runtime.

The model defines attention once, as a custom op: ``softmax(q k^T + bias) v`` with a pre-scaled
``q`` and an additive FP32 ``bias`` (``MASK_BIAS`` on hidden keys) that is the same for every
head. ``to_onnx(..., target=...)`` passes one of the translation tables below to torch's exporter
(``custom_translation_table``); the rest of the graph is identical for every target.

``tensorrt``: standard ONNX ops only, in the pattern TensorRT fuses into one attention kernel
(pre-scaled ``MatMul(q, k^T) -> Add(additive mask) -> Softmax -> MatMul(v)``, checked with
TensorRT-RTX's verbose build log, ``tests/test_lowering.py``). The scores are computed in q's
dtype and cast to FP32 before the bias and the softmax, so an FP16 graph keeps the softmax
statistics FP32 (the precision plan), and the scan's ``attn.scores`` site is exactly the FP16
tensor the graph computes. Every ONNX runtime runs this form.

``onnxruntime``: global layers (a bias that varies along keys only, ``[B, 1, 1, T]``) run
``com.microsoft.MultiHeadAttention``, whose CPU kernel is a memory-efficient flash attention, but
only without ``key_padding_mask`` and ``attention_bias`` inputs (either one selects the unfused
kernel, which materializes all heads' scores). So the key padding is folded into the operands: one
extra head-dim column, 1 in every query and the key's bias in every key, adds exactly the bias to
every score (``[q, 1] . [k, b] = q.k + b``); ``scale`` is 1 (q is pre-scaled). MultiHeadAttention
has only an FP32 kernel on CPU: FP16 operands are cast to FP32 around it (never less precise than
the plan asks). Local (band) layers keep the standard form: the band mask varies per query, which
no fused input form expresses without a mask. TensorRT cannot load ``com.microsoft`` ops.

Measured (ONNX Runtime 1.32 CPU, 2 threads, one global layer H=12, hd=64, random operands; peak
RSS increase over the loaded session; machine shared, so times are provisional, memory is not):

| form (1 x 2048)                                   | MHA node / run | peak increase |
|---------------------------------------------------|---------------:|--------------:|
| MultiHeadAttention, no mask (cannot pad)          | 0.28 s         | 0.05 GiB      |
| MultiHeadAttention, padding folded into q/k (ours)| 0.26 s         | 0.05 GiB      |
| MultiHeadAttention + key_padding_mask             | 0.88 s         | 0.44 GiB      |
| MultiHeadAttention + attention_bias [B, 1, T, T]  | 0.35 s         | 0.49 GiB      |
| MatMul -> Add -> Softmax -> MatMul, all heads      | 0.27 s (total) | 0.78 GiB      |

At 1 x 8192 the folded form stayed at 0.19 GiB (as without a mask) where key_padding_mask took
3.3 GiB and the one-head-at-a-time standard form 1.2 GiB. Whole-model numbers:
``benchmarks/results/onnx_cpu.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

TARGETS = ("onnxruntime", "tensorrt")
FLOAT = 1  # onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class Target:
    """An ONNX form of the model: which runtimes it is for, and what its attention is."""

    name: str
    runtimes: tuple[str, ...]
    attention: str


TARGET_INFO = {
    "onnxruntime": Target("onnxruntime", ("onnxruntime",),
                          "global layers: com.microsoft.MultiHeadAttention (flash kernel); local layers: "
                          "MatMul -> Add -> Softmax -> MatMul"),
    "tensorrt": Target("tensorrt", ("tensorrt", "onnxruntime"),
                       "standard ONNX ops: MatMul -> Add -> Softmax -> MatMul, softmax in FP32"),
}


def _ops():
    from onnxscript import opset18

    return opset18


def _mha():
    """``com.microsoft.MultiHeadAttention`` as an onnxscript op (ONNX Runtime's contrib schema, the
    inputs used here): onnx does not know contrib ops, so the schema is declared."""
    import onnxscript
    from onnx.defs import OpSchema

    p, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[p("query", "T"), p("key", "T", param_option=opt), p("value", "T", param_option=opt)],
        outputs=[p("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "heads"),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "score scale")],
    )
    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MultiHeadAttention", schema)


def standard_attention(q, k, v, bias):
    """MatMul(q, k^T) -> Cast FP32 -> Add(bias) -> Softmax -> Cast -> MatMul(v), for any rank."""
    op = _ops()
    rank = len(k.shape)
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    scores = op.MatMul(q, op.Transpose(k, perm=perm))  # q's dtype; pre-scaled q
    probs = op.Softmax(op.Add(op.Cast(scores, to=FLOAT), bias), axis=-1)  # FP32 statistics
    return op.MatMul(op.CastLike(probs, v), v)


def fused_attention(q, k, v, bias):
    """ONNX Runtime form: MultiHeadAttention with the key padding folded into q and k (module
    docstring); falls back to the standard form where the bias is not per key."""
    shape = bias.shape
    if len(q.shape) != 4 or len(shape) != 4 or shape[1] != 1 or shape[2] != 1:
        return standard_attention(q, k, v, bias)
    heads, head_dim = q.shape[1], q.shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return standard_attention(q, k, v, bias)
    op = _ops()
    dtype = v.dtype
    q, k, v = (op.Cast(x, to=FLOAT) for x in (q, k, v))  # MultiHeadAttention's CPU kernel is FP32

    def dims(*parts):
        return op.Concat(*[p if not isinstance(p, (list, tuple)) else op.Constant(value_ints=list(p)) for p in parts],
                         axis=0)

    batch = op.Shape(q, start=0, end=1)
    q_len, k_len = op.Shape(q, start=2, end=3), op.Shape(k, start=2, end=3)
    ones = op.Expand(op.Constant(value_float=1.0), dims(batch, [heads], q_len, [1]))  # [B, H, Lq, 1]
    key_bias = op.Expand(op.Transpose(bias, perm=[0, 1, 3, 2]), dims(batch, [heads], k_len, [1]))  # [B, H, Lk, 1]
    qa, ka = op.Concat(q, ones, axis=-1), op.Concat(k, key_bias, axis=-1)  # [B, H, L, hd + 1]

    def bsd(x, length, width):  # [B, H, L, d] -> [B, L, H * d]
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), dims(batch, length, [heads * width]))

    out = _mha()(bsd(qa, q_len, head_dim + 1), bsd(ka, k_len, head_dim + 1), bsd(v, k_len, head_dim),
                 num_heads=heads, scale=1.0)  # [B, Lq, H * hd]
    out = op.Transpose(op.Reshape(out, dims(batch, q_len, [heads, head_dim])), perm=[0, 2, 1, 3])
    return op.Cast(out, to=dtype)


def translation_table(target: str) -> dict:
    """``custom_translation_table`` for torch.onnx.export: the attention lowering of ``target``."""
    import torch

    import mbert.modeling.model  # noqa: F401  (registers torch.ops.mbert.attention)

    lowering: Callable = {"onnxruntime": fused_attention, "tensorrt": standard_attention}[target]
    return {torch.ops.mbert.attention.default: lowering}
