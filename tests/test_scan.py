"""The FP16 scan with fused attention: the ``attn.scores`` site is still measured (from q and k; the
scores are never materialized by the model): exactly where it can matter, as a marked upper bound
below 65504/64; it drives the plan; the percentile is ``torch.quantile``'s; progress carries an
ETA; ``device`` is honoured."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_checkpoint, random_batch

from mbert.bundle.errors import ExportError
from mbert.export.device import resolve_device
from mbert.export.fp16.precision import EXACT_SCORES_ABOVE, _quantile, plan, scan, tensor_stats
from mbert.modeling import load_model

SMALL = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=2, intermediate_size=192, local_attention=16)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("scan"), seed=41, **SMALL))


def _explicit_scores_max(model, batches) -> dict[int, float]:
    """max |q k^T| per layer, from the scores written out in full (what the TensorRT form computes)."""
    seen: dict[int, float] = {}
    hooks = [layer.attn.scores.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, max(seen.get(i, 0.0), float((args[0] @ args[1].transpose(-1, -2)).abs().max()))))
        for i, layer in enumerate(model.layers)]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                model(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _scaled(model, layer: int, factor: float):
    """A copy whose layer's Q and K rows are multiplied by ``factor`` (scores by factor**2)."""
    import copy

    loud = copy.deepcopy(model)
    d = loud.config.hidden_size
    with torch.no_grad():
        loud.layers[layer].attn.Wqkv.weight[: 2 * d] *= factor
    return loud


def test_scores_site_bound_and_exact(small):
    """Small scores: a marked upper bound of the true max. Scores past 65504/64 (Q and K of local
    layer 2 and global layer 3 scaled by 30): the exact max, as the explicit scores give it."""
    batches = [random_batch([150], seed=1), random_batch([37], seed=2)]
    report = scan(small, batches)
    want = _explicit_scores_max(small, batches)
    assert set(want) == {0, 1, 2, 3}
    for layer, value in want.items():
        s = report.get(layer, "attn.scores")
        assert s.bound and value <= s.max_abs <= EXACT_SCORES_ABOVE
    loud = _scaled(_scaled(small, 2, 30.0), 3, 30.0)  # layer 2 local, layer 3 global
    report, want = scan(loud, batches), _explicit_scores_max(loud, batches)
    for layer in (2, 3):
        s = report.get(layer, "attn.scores")
        assert not s.bound and s.max_abs == pytest.approx(want[layer], rel=1e-5)
    assert report.get(0, "attn.scores").bound


def test_scores_site_drives_the_plan(small):
    """The same check can fail: scaling layer 2's Q and K rows by 40 moves its scores 1600x, past the
    limit, and the plan then keeps exactly that layer's attention FP32."""
    batches = [random_batch([150], seed=1)]
    loud = _scaled(small, 2, 40.0)
    exact = _explicit_scores_max(small, batches)[2]
    loud_report = scan(loud, batches)
    assert loud_report.get(2, "attn.scores").max_abs == pytest.approx(1600.0 * exact, rel=1e-3)
    limit_margin = 65504.0 / (exact * 40)  # a limit between the quiet and the loud layer
    p = plan(loud_report, margin=limit_margin)
    assert [lp.attention for lp in p.layers] == ["float16", "float16", "float32", "float16"]
    assert (2, "attn.scores") in [(d.layer, d.site) for d in p.decisions]
    assert plan(scan(small, batches), margin=8.0).fp32_layers() == []


def test_percentile_is_torch_quantile():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 999, 1 << 16):
        x = (torch.randn(n, generator=g) ** 3).abs()
        exact = torch.quantile(x.double(), 0.999).float()
        torch.testing.assert_close(_quantile(x, 0.999), exact)
    t = torch.randn(3, 50000, generator=g)
    stats = tensor_stats(t)
    assert float(stats[0]) == float(t.abs().max())
    sample = t.reshape(-1)[:: t.numel() // (1 << 16)][: 1 << 16].abs()
    assert float(stats[1]) == pytest.approx(float(np.quantile(sample.double().numpy(), 0.999)), rel=1e-6)


def test_progress_has_an_eta(small):
    events = []
    scan(small, [random_batch([200], seed=3), random_batch([20], seed=4), random_batch([5], seed=5)],
         progress=events.append)
    assert [e.stage for e in events] == ["scan"] * 3
    assert [e.step for e in events] == ["text 1/3 (200 tokens)", "text 2/3 (20 tokens)", "text 3/3 (5 tokens)"]
    dones = [e.done for e in events]
    assert dones == sorted(dones) and dones[-1] == pytest.approx(events[0].total)
    assert events[0].fraction > 0.85  # the 200-token text is most of the work, so the ETA weighs it so
    assert events[0].eta_s is not None and events[-1].eta_s == 0.0
    assert "scan:" in events[0].line() and "left" in events[0].line()


def test_validation_reports_progress_per_case_weighted_by_its_cost(small):
    from mbert.bundle.validation import FP32_TOLERANCE, Case, compare
    from mbert.export.progress import case_progress

    cases = [Case(name, *(np.asarray(a) for a in random_batch(lengths, seed=n)))
             for n, (name, lengths) in enumerate((("long", [600, 3]), ("short", [7]), ("one token", [1])))]
    echo = lambda ids, mask: {"x": ids.astype(np.float64)}  # noqa: E731 - runner and reference alike
    events = []
    report = compare("graph", echo, echo, cases, {"x": FP32_TOLERANCE},
                     case_progress("validate", small.config, cases, events.append))
    assert report.passed and [e.stage for e in events] == ["validate"] * 3
    assert [e.step for e in events] == ["case 1/3 (long)", "case 2/3 (short)", "case 3/3 (one token)"]
    assert events[0].fraction > 0.95 and events[-1].fraction == pytest.approx(1.0)  # 2 x 600 tokens dominate
    assert case_progress("validate", small.config, cases, None) is None  # nobody listens: no callback


def test_device(small):
    report = scan(small, [random_batch([30], seed=6)], device="cpu")
    assert report.num_tokens == 30
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ExportError, match="--device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ExportError, match="no CUDA GPU"):
            scan(small, [random_batch([30], seed=6)], device="cuda")
