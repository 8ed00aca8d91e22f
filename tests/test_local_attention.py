"""Attention is defined once (``mbert::attention``): its eager form (PyTorch's SDPA) equals the
explicit softmax form; blocked local attention equals the band-masked reference at every length
from 1 to 3 windows and costs memory linear in the sequence length; each check can fail."""
from __future__ import annotations

import pytest
import torch

from mbert.bundle.config import ModernBertConfig
from mbert.modeling.model import MASK_BIAS, Attention, attention, global_bias, local_bias


def _band_reference(q, k, v, mask, w):
    """softmax over keys with |i - j| <= w and not padding, the definition in docs/modernbert.md."""
    T = q.shape[2]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    visible = ((i - j).abs() <= w)[None, None] & mask.bool()[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


def _attention(window: int) -> Attention:
    cfg = ModernBertConfig(vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, local_attention=2 * window, layer_types=("full_attention",) * 2)
    return Attention(cfg, is_global=False)


@pytest.mark.parametrize("w", [4, 8])
def test_blocked_equals_band_reference(w):
    attn = _attention(w)
    g = torch.Generator().manual_seed(w)
    for T in range(1, 3 * (2 * w + 1) + 2):  # 1 .. 3 windows (+1)
        q, k, v = (torch.randn(2, 2, T, 16, generator=g) for _ in range(3))
        mask = torch.ones(2, T, dtype=torch.int64)
        mask[1, max(1, T - T // 3):] = 0  # right padding on the second row
        got = attn._local(q, k, v, local_bias(mask, w))
        want = _band_reference(q, k, v, mask, w)
        keep = mask.bool()
        torch.testing.assert_close(got.transpose(1, 2)[keep], want.transpose(1, 2)[keep], atol=1e-5, rtol=1e-5)


def test_reference_itself_detects_a_wrong_window():
    """The comparison above can fail: a band one wider differs from the reference."""
    w, T = 8, 40
    attn = _attention(w)
    q, k, v = (torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(1, T, dtype=torch.int64)
    wrong = attn._local(q, k, v, local_bias(mask, w + 1))
    assert (wrong - _band_reference(q, k, v, mask, w)).abs().max() > 1e-3


def test_local_bias_is_linear_in_length_and_finite():
    w = 64
    for T in (128, 1024, 8192):
        b = local_bias(torch.ones(1, T, dtype=torch.int64), w)
        assert b.numel() == (-(-T // w)) * w * 3 * w  # nb * w * 3w: linear in T
        assert torch.isfinite(b).all() and b.min() == MASK_BIAS
    assert torch.isfinite(global_bias(torch.zeros(2, 5, dtype=torch.int64))).all()


def _explicit(q, k, v, bias):
    """softmax(q k^T + bias) v written out: scores in q's dtype, softmax in FP32 (the TensorRT form)."""
    return ((q @ k.transpose(-1, -2)).float() + bias).softmax(-1).to(v.dtype) @ v


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, {}), (torch.float16, dict(atol=2e-3, rtol=2e-3)),
                                       (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_eager_attention_equals_explicit_form(device, dtype, tol):
    """The eager op (SDPA) and the explicit form agree, global ([B, 1, 1, T] key bias, padded rows)
    and local ([B, 1, nb, w, 3w] band bias); in FP32 to assert_close's default tolerance."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 40, dtype=torch.int64)
    mask[1, 25:], mask[2, 3:] = 0, 0
    w = 8
    cases = [((3, 4, 40, 16), (3, 4, 40, 16), global_bias(mask)),
             ((3, 4, 5, w, 16), (3, 4, 5, 3 * w, 16), local_bias(mask, w))]
    for q_shape, k_shape, bias in cases:
        q = (torch.randn(q_shape, generator=g) * 0.25).to(device, dtype)
        k, v = (torch.randn(k_shape, generator=g).to(device, dtype) for _ in range(2))
        got = attention(q, k, v, bias.to(device))
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got, _explicit(q, k, v, bias.to(device)), **tol)


def test_eager_attention_check_detects_a_dropped_mask():
    """The comparison above can fail: the same op without the padding bias differs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 30, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 30, dtype=torch.int64)
    mask[1, 10:] = 0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(attention(q, k, v, global_bias(torch.ones_like(mask))),
                                   _explicit(q, k, v, global_bias(mask)))
