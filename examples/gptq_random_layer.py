"""Quantize one random linear layer with GPTQ and compare it with round-to-nearest.

The inputs are correlated (a few dominant directions plus outlier channels), as real
activations are, which is where GPTQ's error feedback pays off. Runs on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

import forge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out-features", type=int, default=1024)
    ap.add_argument("--in-features", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(args.seed)
    n, k, t = args.out_features, args.in_features, args.tokens
    basis = torch.randn(8, k, generator=g)
    x = torch.randn(t, 8, generator=g) @ basis * 2 + 0.3 * torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:16]] *= 20  # outlier channels
    w = torch.randn(n, k, generator=g) / k**0.5
    h = 2 * x.T @ x / t

    def layer_err(wq: torch.Tensor) -> float:
        return float(((x @ (w - wq).T) ** 2).sum() / ((x @ w.T) ** 2).sum())

    rows = []
    for mode in ("range", "mse"):
        t0 = time.perf_counter()
        qmeta, _, _ = forge.build_quant_grid(w, args.group_size, 4, False, mode)
        codes = forge.quantize_rtn(w, qmeta, 4, args.group_size)
        rtn = forge.dequantize_awq(*forge.pack_awq(codes, qmeta, args.group_size), args.group_size)
        rows.append((f"RTN, {mode} grid", layer_err(rtn), time.perf_counter() - t0))
        for act_order in (False, True):
            t0 = time.perf_counter()
            res = forge.gptq_quantize(w, h, group_size=args.group_size, mode=mode, act_order=act_order)
            packed = forge.pack_awq(res.codes, res.qmeta, args.group_size)
            deq = forge.dequantize_awq(*packed, args.group_size)
            name = f"GPTQ, {mode} grid" + (", act-order" if act_order else "")
            rows.append((name, layer_err(deq), time.perf_counter() - t0))

    print(f"layer {n}x{k}, {t} calibration tokens, 4-bit asymmetric, group {args.group_size}")
    print(f"{'method':32s} {'rel. output error':>18s} {'vs RTN':>8s} {'time':>8s}")
    base = rows[0][1]
    for name, err, dt in rows:
        print(f"{name:32s} {err:18.3e} {err / base:8.3f} {dt:7.2f}s")


if __name__ == "__main__":
    main()
