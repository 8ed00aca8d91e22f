"""ModernBERT for export, in forward order.

Module names equal the checkpoint's tensor names, so loading is a strict ``load_state_dict``.
Written to trace: no unpadding, no ``.item()``, no Python branch on tensor values; the band
mask is built from positions with constant shapes. The arithmetic is the one in
``docs/modernbert.md``; every difference from transformers' reference is a choice stated here:

* Attention is one custom op, ``mbert::attention`` (``attention`` below): ``softmax(q k^T + bias) v``
  with a pre-scaled q and an additive FP32 bias shared by all heads. Eager PyTorch runs
  ``scaled_dot_product_attention`` (fused, FP32 softmax statistics; on CPU 3-4.5x faster than
  the explicit form for global layers at 4 x 512 .. 1 x 8192 and 1.3-2x for local blocks, equal
  to assert_close's FP32 tolerance, ``tests/test_local_attention.py``; written for CUDA too, not
  measured on a GPU here). Exported graphs get the form of their target runtime
  (``mbert.export.onnx.lowering``): fused ``MultiHeadAttention`` for ONNX Runtime, standard ops in
  TensorRT's fusion pattern for TensorRT. The scan measures the scores from q and k (``Probe``).
* Local (sliding-window) layers use *blocked* attention: the padded sequence is cut into blocks
  of ``local_attention // 2`` queries, each block attends to itself and its two neighbours
  (3 blocks of keys) under one constant band mask. Work and memory are linear in the sequence
  length and the numbers equal the band-masked reference (``tests/test_local_attention.py``).
* Masks are a finite additive bias (``MASK_BIAS``), built once per forward and added in FP32
  right before the softmax: no ``-inf`` constant exists anywhere in the traced graph, so an FP16
  conversion cannot create an all ``-inf`` row (and NaN) for a query whose window lies in padding.
  (An additive bias rather than ``Where``: ONNX Runtime's broadcasting ``Where`` took 47% of a
  1 x 8192 forward, measured with its profiler.)
* Precision follows the weights (the usual PyTorch idiom): a layer's residual stream is kept in
  the dtype of its norm weights, attention and MLP compute in the dtype of their matrices, and
  softmax and LayerNorm statistics are always FP32. In an all-FP32 model every cast is a no-op;
  ``mbert.export.fp16.precision.to_mixed_precision`` sets dtypes per layer from a measured plan and
  the same code then traces to an ONNX graph with explicit ``Cast`` nodes at every boundary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mbert.bundle.config import ModernBertConfig

MASK_FILL = -65504.0  # most negative finite float16; finite in float32 and bfloat16 too
# Additive bias for hidden keys. exp(-1e4) is 0 in every float type, and s - 1e4 stays finite in
# FP16 for any score |s| < 55000, so even a naive FP16 conversion of the graph cannot turn a fully
# masked row (a padding query whose whole window is padding) into -inf and NaN.
MASK_BIAS = -1.0e4


def activation(name: str):
    """transformers' ``ACT2FN[name]`` for the activations ModernBERT configs use."""
    tanh_gelu = lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))  # noqa: E731
    table = {
        "gelu": F.gelu,  # exact erf GELU
        "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": tanh_gelu,
        "gelu_accurate": tanh_gelu,
        "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
        "mish": F.mish,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
    }
    return table[name]


class LayerNorm(nn.Module):
    """Weight-only (or weight+bias) LayerNorm whose statistics are always computed in FP32.

    The output keeps the input's dtype. For FP32 input this is exactly ``nn.LayerNorm``.
    """

    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class Probe(nn.Module):
    """A named point inside a forward pass (no parameters, no graph node) that the FP16 scan hooks.

    It returns its inputs unchanged. ``Attention.scores`` receives ``(q, k)``: the scores ``q k^T``
    are never materialized by the fused attention, so the scan computes them from their factors.
    """

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors


def rope_tables(seq_len: int | torch.SymInt, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim, computed in FP32 like the reference."""
    xf = x.float()  # [B, H, T, hd]
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(input_ids)  # [B, T, D]
        return self.norm(x.to(self.norm.weight.dtype))


@torch.library.custom_op("mbert::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T + bias) v``: the one definition of attention, lowered per target on export.

    q [B, H, *blocks, Lq, d] (already scaled by 1/sqrt(d)), k [B, H, *blocks, Lk, d], v [.., Lk, dv];
    bias: additive FP32 [B, 1, *blocks, Lq or 1, Lk] (finite, ``MASK_BIAS`` on hidden keys), the
    same for every head. Returns [B, H, *blocks, Lq, dv] in v's dtype. Eager: PyTorch's
    ``scaled_dot_product_attention`` (fused, FP32 softmax statistics); ONNX: the translations in
    ``mbert.export.onnx.lowering`` (standard ops for TensorRT, a fused kernel for ONNX Runtime).
    """
    batch = q.shape[:1] + q.shape[2:-2]  # (B, *blocks): one batch axis, heads just before the sequence
    q4, k4, v4 = (x.movedim(1, -3).flatten(0, -4) for x in (q, k, v))  # [N, H, L, d]
    mask = bias.movedim(1, -3).flatten(0, -4).to(q.dtype)  # [N, 1, Lq or 1, Lk]
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=1.0)  # [N, H, Lq, dv]
    return out.unflatten(0, batch).movedim(-3, 1).to(v.dtype)


@attention.register_fake
def _(q, k, v, bias):
    return q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=v.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModernBertConfig, is_global: bool):
        super().__init__()
        self.is_global = is_global
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.scores = Probe()
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, h, cos, sin, bias):
        B, T, D = h.shape
        qkv = self.Wqkv(h.to(self.Wqkv.weight.dtype))  # [B, T, 3D]
        qkv = qkv.view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, T, hd]
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = apply_rope(q, cos, sin) * (self.head_dim**-0.5)  # pre-scaled Q (TensorRT's fusion pattern)
        k = apply_rope(k, cos, sin)
        if self.is_global:
            self.scores(q, k)  # scores q k^T: [B, H, T, T]
            out = attention(q, k, v, bias)  # [B, H, T, hd]; bias [B, 1, 1, T]
        else:
            out = self._local(q, k, v, bias)
        out = out.transpose(1, 2).reshape(B, T, D)  # [B, T, D]
        return self.Wo(out)

    def _local(self, q, k, v, bias):
        """Band attention |i - j| <= w, in blocks of w queries against 3 blocks of keys."""
        B, H, T, hd = q.shape
        w = bias.shape[-2]  # the block size the model built the bias for
        nb, pad = blocks(T, w)
        qb = F.pad(q, (0, 0, 0, pad)).view(B, H, nb, w, hd)  # [B, H, nb, w, hd]
        kb = F.pad(k, (0, 0, w, pad + w)).view(B, H, nb + 2, w, hd)
        vb = F.pad(v, (0, 0, w, pad + w)).view(B, H, nb + 2, w, hd)
        kn = torch.cat((kb[:, :, :-2], kb[:, :, 1:-1], kb[:, :, 2:]), dim=3)  # [B, H, nb, 3w, hd]
        vn = torch.cat((vb[:, :, :-2], vb[:, :, 1:-1], vb[:, :, 2:]), dim=3)
        self.scores(qb, kn)  # scores [B, H, nb, w, 3w]
        out = attention(qb, kn, vn, bias)  # [B, H, nb, w, hd]; bias [B, 1, nb, w, 3w]
        return out.reshape(B, H, nb * w, hd)[:, :, :T]  # [B, H, T, hd]


def blocks(T: int | torch.SymInt, w: int) -> tuple[int | torch.SymInt, int | torch.SymInt]:
    """(number of blocks of w, padding to a whole block): ``nb * w == T + pad`` by construction,
    which the tracer's symbolic shapes see without proving anything about remainders."""
    nb = (T + w - 1) // w
    return nb, nb * w - T


def global_bias(attention_mask: torch.Tensor) -> torch.Tensor:
    """Additive FP32 key-padding bias for global layers: [B, 1, 1, T]."""
    valid = attention_mask.bool()[:, None, None, :]
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill(~valid, MASK_BIAS)


def local_bias(attention_mask: torch.Tensor, w: int) -> torch.Tensor:
    """Additive FP32 bias for blocked band attention: [B, 1, nb, w, 3w].

    Query r of a block sits at key column w + r of its 3-block neighbourhood and sees columns
    r .. r + 2w (|i - j| <= w); keys in padding or beyond the sequence are hidden.
    """
    B, T = attention_mask.shape
    nb, pad = blocks(T, w)
    valid = F.pad(attention_mask.bool(), (w, pad + w), value=False).view(B, nb + 2, w)
    valid = torch.cat((valid[:, :-2], valid[:, 1:-1], valid[:, 2:]), dim=2)  # [B, nb, 3w]
    r = torch.arange(w, device=attention_mask.device)[:, None]
    c = torch.arange(3 * w, device=attention_mask.device)[None, :]
    band = (c >= r) & (c <= r + 2 * w)  # [w, 3w], constant
    visible = band[None, None] & valid[:, None, :, None, :]  # [B, 1, nb, w, 3w]
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, MASK_BIAS)


class MLP(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_activation)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g, u = self.Wi(h.to(self.Wi.weight.dtype)).chunk(2, dim=-1)  # first half is activated
        return self.Wo(self.act(g) * u)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int):
        super().__init__()
        # layer 0 has no attn_norm tensor: the embedding norm precedes it
        self.attn_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_bias) if index > 0 else nn.Identity()
        self.attn = Attention(cfg, cfg.is_global(index))
        self.mlp_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias):
        x = x.to(self.mlp_norm.weight.dtype)  # the residual stream's dtype in this layer
        x = x + self.attn(self.attn_norm(x), cos, sin, bias).to(x.dtype)
        x = x + self.mlp(self.mlp_norm(x)).to(x.dtype)
        return x  # [B, T, D]


class ModernBertModel(nn.Module):
    """The encoder: ``forward(input_ids, attention_mask) -> last_hidden_state [B, T, D]``."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)
        self.window = cfg.window_half_width  # local layers see |i - j| <= window; also the block size
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the two RoPE inverse-frequency tables, in FP32, on the weights' device.

        They come from the thetas, not the checkpoint; the loader calls this again after moving
        the model so that a model loaded in FP16 still rotates with FP32 frequencies.
        """
        cfg, device = self.config, self.final_norm.weight.device
        for kind, theta in (("global", cfg.global_rope_theta), ("local", cfg.local_rope_theta)):
            exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim
            self.register_buffer(f"{kind}_inv_freq", 1.0 / (theta**exponent), persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        g_bias = global_bias(attention_mask)  # [B, 1, 1, T]
        l_bias = local_bias(attention_mask, self.window)  # [B, 1, nb, w, 3w]
        g_cos, g_sin = rope_tables(T, self.global_inv_freq)  # [T, hd] each
        l_cos, l_sin = rope_tables(T, self.local_inv_freq)
        x = self.embeddings(input_ids)  # [B, T, D]
        for layer in self.layers:
            if layer.attn.is_global:
                x = layer(x, g_cos, g_sin, g_bias)
            else:
                x = layer(x, l_cos, l_sin, l_bias)
        return self.final_norm(x.to(self.final_norm.weight.dtype))  # [B, T, D]


class PredictionHead(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = activation(cfg.classifier_activation)
        self.norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x.to(self.dense.weight.dtype))))


class _HeadModel(nn.Module):
    """The encoder (``model.``) and its prediction head (``head.``): what every head checkpoint has."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.config = cfg
        self.model = ModernBertModel(cfg)
        self.head = PredictionHead(cfg)


class ModernBertForMaskedLM(_HeadModel):
    """``forward -> logits [B, T, V]``; the decoder weight is the token embedding (tied)."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.decoder_bias)
        if cfg.tie_word_embeddings:
            self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.head(self.model(input_ids, attention_mask))
        return self.decoder(h.to(self.decoder.weight.dtype))  # [B, T, V]


class _ClassifierModel(_HeadModel):
    """Encoder, prediction head and a ``classifier`` layer: the two classification checkpoints."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(x).to(self.classifier.weight.dtype))


class ModernBertForSequenceClassification(_ClassifierModel):
    """``forward -> logits [B, num_labels]``, pooled by ``classifier_pooling`` (cls or mean)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, attention_mask)  # [B, T, D]
        if self.config.classifier_pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1)
        return self.classify(pooled)  # [B, num_labels]


class ModernBertForTokenClassification(_ClassifierModel):
    """``forward -> logits [B, T, num_labels]``."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classify(self.model(input_ids, attention_mask))  # [B, T, num_labels]


MODEL_CLASSES = {
    "encoder": ModernBertModel,
    "masked-lm": ModernBertForMaskedLM,
    "sequence-classification": ModernBertForSequenceClassification,
    "token-classification": ModernBertForTokenClassification,
}


def encoder_of(model: nn.Module) -> ModernBertModel:
    """The ModernBertModel inside ``model`` (itself for an encoder checkpoint, ``.model`` for heads)."""
    return model if isinstance(model, ModernBertModel) else model.model


def build_model(cfg: ModernBertConfig) -> nn.Module:
    """An uninitialised model of the class ``cfg.architectures`` selects."""
    return MODEL_CLASSES[cfg.task](cfg)
