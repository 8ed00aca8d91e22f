#!/usr/bin/env python
"""What this machine's kernels allow: the arithmetic floor of the FP16 scan and of a 1 x 8192 forward.

Measures, in one run, the rates of the kernels the work is made of, at the model's own shapes:
torch's ``mm`` (the linears of the eager scan) and ``scaled_dot_product_attention`` (its global
attention), ONNX Runtime's ``MatMul`` and ``com.microsoft.MultiHeadAttention`` (the ORT graph at
1 x 8192; head dim 65 as the graph folds the key padding into it). Then divides the FLOPs of the
work by them:

  scan floor     the built-in calibration texts (one per forward, as the scan runs them) through
                 ModernBERT-base: linears at the mm rate + attention at the SDPA rate
  8192 floor     1 x 8192 through the ORT graph: linears at the MatMul rate + global attention at
                 the MultiHeadAttention rate (local attention and every element-wise op left out)

Element-wise work, hooks, padding and Python are all left out, so a floor is a lower bound: no
implementation on these kernels goes below it. With transformers' ONNX latency from
``results/onnx_cpu.json`` (same day, same machine) it gives the largest speed-up the kernels allow.

    python benchmarks/floor.py            # -> results/floor.md
    python benchmarks/floor.py --quick --out /tmp/x   # smoke test: the kernels at 1/8 to 1/16 of the
                                                      # shapes (rates of small shapes) -> floor_quick.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from mbert.bundle.config import ModernBertConfig
from mbert.runtime.backends.onnxruntime import session_options

REPO = Path(__file__).resolve().parents[1]
CFG = ModernBertConfig.from_file(REPO / "tests" / "fixtures" / "modernbert-base" / "config.json")  # the published one
D, INTER, LAYERS = CFG.hidden_size, CFG.intermediate_size, CFG.num_hidden_layers
HEADS, HEAD_DIM, WINDOW = CFG.num_attention_heads, CFG.head_dim, CFG.window_half_width
GLOBAL = sum(CFG.is_global(i) for i in range(LAYERS))
LINEAR_FLOPS_PER_TOKEN = 2 * LAYERS * (D * 3 * D + D * D + D * 2 * INTER + INTER * D)


def attention_flops(T: int, local: bool) -> float:
    keys = 3 * WINDOW if local else T  # blocked band attention: 3 blocks of keys per block of queries
    return 4.0 * HEADS * HEAD_DIM * T * keys  # q k^T and p v, 2 FLOPs per multiply-add


def best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


FULL_SIZES = dict(mm_tokens=1024, sdpa_T=4096, matmul_tokens=8192, mha_T=8192)
QUICK_SIZES = dict(mm_tokens=128, sdpa_T=256, matmul_tokens=512, mha_T=512)


def torch_rates(threads: int, sizes: dict) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    n = sizes["mm_tokens"]
    x = torch.randn(n, D)
    mats = [torch.randn(D, 3 * D), torch.randn(D, D), torch.randn(D, 2 * INTER)]
    h = torch.randn(n, INTER)
    wo = torch.randn(INTER, D)
    flops = 2 * n * (D * 3 * D + D * D + D * 2 * INTER + INTER * D)
    mm = flops / best(lambda: ([x @ w for w in mats], h @ wo)) / 1e9
    T = sizes["sdpa_T"]
    q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM) * 0.1 for _ in range(3))
    mask = torch.zeros(1, 1, 1, T)
    sdpa = attention_flops(T, False) / best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0),
                                            2) / 1e9
    return {f"torch mm (linears, {n} tokens)": mm, f"torch SDPA (global, T={T})": sdpa}


def ort_rates(threads: int, sizes: dict) -> dict[str, float]:
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def session(nodes, inputs, opsets):
        model = helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", 1, None)]),
                                  opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
        return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                    providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(0)
    M = sizes["matmul_tokens"]
    total_s = 0.0
    for k_dim, n_dim in ((D, 3 * D), (D, D), (D, 2 * INTER), (INTER, D)):
        w = helper.make_tensor("w", TensorProto.FLOAT, [k_dim, n_dim], rng.standard_normal((k_dim, n_dim)).astype(np.float32).ravel())
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, k_dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
        s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                 session_options(threads), providers=["CPUExecutionProvider"])
        feed = {"x": rng.standard_normal((M, k_dim)).astype(np.float32)}
        total_s += best(lambda: s.run(None, feed), 2)
    matmul = 2 * M * (D * 3 * D + D * D + D * 2 * INTER + INTER * D) / total_s / 1e9
    T, qk = sizes["mha_T"], HEAD_DIM + 1
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, T, HEADS * d]) for n, d in (("q", qk), ("k", qk), ("v", HEAD_DIM))]
    mha = session([helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain="com.microsoft",
                                    num_heads=HEADS, scale=1.0)], ins, [("", 18), ("com.microsoft", 1)])
    feed = {n: (rng.standard_normal((1, T, HEADS * d)) * 0.1).astype(np.float32) for n, d in (("q", qk), ("k", qk), ("v", HEAD_DIM))}
    rate = attention_flops(T, False) / best(lambda: mha.run(None, feed), 1) / 1e9
    return {f"ORT MatMul (linears, {M} tokens)": matmul, f"ORT MultiHeadAttention (global, T={T}, head dim 65)": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="smoke test: small kernel shapes -> floor_quick.md")
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    from mbert.bundle.texts import calibration_texts
    from mbert.bundle.tokenizer import load_tokenizer

    tok = load_tokenizer(REPO / "tests" / "fixtures" / "modernbert-base")
    lengths = [min(len(tok.encode(t).ids), 8192) for t in calibration_texts()]
    rates = {**torch_rates(args.threads, sizes), **ort_rates(args.threads, sizes)}
    mm, sdpa, matmul, mha = rates.values()
    scan_lin = sum(lengths) * LINEAR_FLOPS_PER_TOKEN
    scan_att = sum(GLOBAL * attention_flops(T, False) + (LAYERS - GLOBAL) * attention_flops(T, True) for T in lengths)
    scan_floor = scan_lin / mm / 1e9 + scan_att / sdpa / 1e9
    lin_8192, att_8192 = 8192 * LINEAR_FLOPS_PER_TOKEN, GLOBAL * attention_flops(8192, False)
    floor_8192 = lin_8192 / matmul / 1e9 + att_8192 / mha / 1e9
    results = args.out / "onnx_cpu.json"
    hf = None
    if results.exists():
        rows = json.loads(results.read_text())["results"]
        hf = next((r["latency_s"] for r in rows if r["system"] == "hf-onnx" and r["shape"] == "1x8192"
                   and r.get("status") == "ok"), None)
    L = [f"# The arithmetic floor on this machine (ModernBERT-base){' (--quick: small shapes)' if args.quick else ''}\n",
         f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; threads: {args.threads}",
         "- command: `python benchmarks/floor.py`", "", "| kernel | GFLOP/s |", "|---|---:|"]
    L += [f"| {k} | {v:.0f} |" for k, v in rates.items()]
    L += ["", "| work | FLOPs (T) | floor (s) |", "|---|---:|---:|",
          f"| FP16 scan: {len(lengths)} texts, {sum(lengths)} tokens (linears + attention) | "
          f"{(scan_lin + scan_att) / 1e12:.1f} | {scan_floor:.1f} |",
          f"| 1 x 8192 on ORT (linears + global attention) | {(lin_8192 + att_8192) / 1e12:.2f} | {floor_8192:.1f} |"]
    if hf:
        L += ["", f"transformers' ONNX at 1 x 8192 (`results/onnx_cpu.json`): {hf:.1f} s, so the largest speed-up "
                  f"these kernels allow is {hf / floor_8192:.2f}x."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("floor_quick.md" if args.quick else "floor.md")).write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
