"""GPU check of the FP16 plan in PyTorch CUDA: parity and speed of this project's mixed-precision
eager model (the same plan ``model.fp16.onnx`` is traced from) against transformers' sdpa FP16
on the same GPU, on random full-size gte-modernbert-base weights, plus the overflow checkpoint.

    python benchmarks/gpu_fp16.py --out benchmarks/results          # on a CUDA machine
    python benchmarks/gpu_fp16.py --small --device cpu --out /tmp/x  # smoke test of the script

TensorRT is not exercised here (not installable on these machines): this checks the plan's
arithmetic on a GPU, not the engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


def _time(fn, device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model and shapes (smoke test)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    import transformers
    from helpers import TINY, make_checkpoint

    from mbert.bundle.texts import calibration_texts
    from mbert.bundle.tokenizer import load_tokenizer
    from mbert.bundle.validation import build_cases, default_grid
    from mbert.export.fp16.precision import plan, scan, scan_batches, to_mixed_precision
    from mbert.modeling import Pooling, load_model, load_pooling

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 reference stays FP32
    torch.backends.cudnn.allow_tf32 = False
    small = TINY if args.small else {}  # --small: the tests' 2-layer model at 128 tokens (FP16 on a CPU is slow)
    max_len = 128 if args.small else 8192
    shapes = [(2, 32), (1, 128)] if args.small else [(32, 512), (8, 2048), (1, 8192)]
    lines, record = [], {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "torch": torch.__version__, "transformers": transformers.__version__}

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "gte", "gte-modernbert-base", seed=0, layout="cls-pooling", **small)
        ours32 = load_model(ckpt, device=device)
        pooling = Pooling.of(load_pooling(ckpt))
        tok = load_tokenizer(ckpt)
        texts = calibration_texts()
        t0 = time.perf_counter()
        report = scan(ours32, [(i.to(device), m.to(device)) for i, m in scan_batches(tok, texts, max_len)])
        p = plan(report)
        mixed = to_mixed_precision(ours32, p)
        say(f"# GPU FP16 check ({record['device']}, torch {torch.__version__}, transformers {transformers.__version__})")
        say(f"scan + plan: {time.perf_counter() - t0:.1f}s over {report.num_texts} texts, {report.num_tokens} tokens; "
            f"max |x| {max(s.max_abs for s in report.stats):.4g}; FP32 layers: {p.fp32_layers() or 'none'}")
        hf16 = transformers.AutoModel.from_pretrained(ckpt, attn_implementation="sdpa", dtype=torch.float16).to(device).eval()

        cases = build_cases(tok, texts, default_grid(ours32.config.window_half_width, max_len) + [("max length", [max_len])],
                            50281, 50282, 50283)
        say("\n## Parity against the FP32 eager model (pooled CLS cosine, worst token cosine)")
        say("| case | ours mixed FP16: pooled | tokens | finite | transformers sdpa FP16: pooled | tokens | finite |")
        say("|---|---|---|---|---|---|---|")
        parity = []
        with torch.no_grad():
            for case in cases:
                ids = torch.from_numpy(case.input_ids).to(device)
                mask = torch.from_numpy(case.attention_mask).to(device)
                keep = mask.bool()
                ref = ours32(ids, mask)
                ours = mixed(ids, mask).float()
                hf = hf16(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                row = dict(case=case.describe(),
                           ours_pooled=_cos(pooling(ours, mask), pooling(ref, mask)), ours_tokens=_cos(ours[keep], ref[keep]),
                           ours_finite=bool(torch.isfinite(ours[keep]).all()),
                           hf_pooled=_cos(pooling(hf, mask), pooling(ref, mask)), hf_tokens=_cos(hf[keep], ref[keep]),
                           hf_finite=bool(torch.isfinite(hf[keep]).all()))
                parity.append(row)
                say(f"| {row['case']} | {row['ours_pooled']:.7f} | {row['ours_tokens']:.5f} | {row['ours_finite']} | "
                    f"{row['hf_pooled']:.7f} | {row['hf_tokens']:.5f} | {row['hf_finite']} |")
        record["parity"] = parity

        say("\n## Speed (median ms over repeats, full-length random batches)")
        say("| shape | ours mixed FP16 eager | transformers sdpa FP16 | ratio (sdpa / ours) | target >= 0.9x |")
        say("|---|---|---|---|---|")
        speed = []
        with torch.no_grad():
            for b, t in shapes:
                ids = torch.randint(0, 50000, (b, t), device=device)
                mask = torch.ones_like(ids)
                a = _time(lambda: mixed(ids, mask), device, args.repeats)
                h = _time(lambda: hf16(input_ids=ids, attention_mask=mask), device, args.repeats)
                speed.append(dict(shape=f"{b}x{t}", ours_ms=a, hf_ms=h))
                say(f"| {b} x {t} | {a:.2f} | {h:.2f} | {h / a:.2f}x | {'met' if h / a >= 0.9 else 'MISSED'} |")
        record["speed"] = speed

        say("\n## Overflow checkpoint (layer 1 MLP output x30000: residual stream passes 65504)")
        ovf = make_checkpoint(Path(tmp) / "ovf", "gte-modernbert-base", seed=31, layout="cls-pooling",
                              scale_layer_mlp=(1, 30000.0), **dict(small, num_hidden_layers=4))
        o32 = load_model(ovf, device=device)
        op = plan(scan(o32, [(i.to(device), m.to(device)) for i, m in scan_batches(tok, texts, min(1024, max_len))]))
        omixed = to_mixed_precision(o32, op)
        ohf16 = transformers.AutoModel.from_pretrained(ovf, attn_implementation="sdpa", dtype=torch.float16).to(device).eval()
        ids, mask = (torch.from_numpy(x).to(device) for x in (cases[6].input_ids, cases[6].attention_mask))
        with torch.no_grad():
            ref, ours = o32(ids, mask), omixed(ids, mask).float()
            hf = ohf16(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        keep = mask.bool()
        ovf_row = dict(fp32_layers=op.fp32_layers(), ours_finite=bool(torch.isfinite(ours[keep]).all()),
                       ours_pooled=_cos(pooling(ours, mask), pooling(ref, mask)),
                       hf_finite=bool(torch.isfinite(hf[keep]).all()))
        record["overflow"] = ovf_row
        say(f"plan keeps layers {ovf_row['fp32_layers']} (partly) FP32; ours finite: {ovf_row['ours_finite']}, "
            f"pooled cosine {ovf_row['ours_pooled']:.7f}; transformers FP16 finite: {ovf_row['hf_finite']}")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_fp16.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu_fp16.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
