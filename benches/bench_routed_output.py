"""GPU benchmark of the calibration's expert passes at DeepSeek-V3 scale against the plain
formulation they replaced, run in the same process: the routed output of every calibration
token (``forge.calibrate._routed_output``: gate and up stacked in one GEMM, the down projection
straight to fp32) against the same pass with each expert's output computed as
``act(x Gᵀ) * (x Uᵀ)`` then a bf16 down projection widened to fp32; and the down-projection inputs of every routed pair (what the down Hessians read),
one stacked GEMM against two.

    python benches/bench_routed_output.py [--tokens 2097152] [--json out.json]

256 experts (7168 -> 2048 -> 7168, bf16), top-8 routing drawn from a skewed (Zipf 0.7)
expert popularity. Needs about 60 GB of GPU memory at 2M tokens (plus a host copy).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import forge.calibrate as cal

E, D, INTER, K = 256, 7168, 2048, 8


def reference_hidden(self, e: int, x: torch.Tensor) -> torch.Tensor:
    """The replaced formulation of an expert's down-projection input: gate and up apart."""
    gu = self.w[e][0]
    return self.act(F.linear(x, gu[:INTER])) * F.linear(x, gu[INTER:])


def reference_output(self, e: int, x: torch.Tensor) -> torch.Tensor:
    """The replaced formulation of an expert's output: the down projection in bf16, widened."""
    return F.linear(reference_hidden(self, e, x), self.w[e][1]).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2097152)
    ap.add_argument("--json", help="write the rows here (after each row, so a failure keeps them)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = {
        e: [torch.randn(2 * INTER, D, device=dev, dtype=torch.bfloat16) * 0.02, torch.randn(D, INTER, device=dev, dtype=torch.bfloat16) * 0.02]
        for e in range(E)
    }  # fmt: skip
    routed = cal._RoutedExperts(w, E, F.silu)
    t = args.tokens
    xs = torch.randn(t, D, device=dev, dtype=torch.bfloat16)
    p = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 0.7)[torch.randperm(E)]
    gumbel = -torch.log(-torch.log(torch.rand(t, E, device=dev)))
    idx = torch.topk(torch.log(p.float().to(dev)) + gumbel, K, dim=1).indices
    del gumbel
    wts = torch.softmax(torch.randn(t, K, device=dev), 1)
    rows = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rows[name] = time.perf_counter() - t0
        print(f"{name:44s} {rows[name]:7.3f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

    order = torch.argsort(idx.reshape(-1), stable=True)
    starts = [0]
    for c in torch.bincount(idx.reshape(-1), minlength=E).tolist():
        starts.append(starts[-1] + c)

    def hidden_pass(stacked: bool):
        s = torch.zeros((), device=dev)
        for e in range(E):
            sel = order[starts[e] : starts[e + 1]]
            for r0 in range(0, sel.numel(), cal.GATHER_ROWS):
                x = xs.index_select(0, sel[r0 : r0 + cal.GATHER_ROWS] // K)
                a = routed.hidden(e, x) if stacked else reference_hidden(routed, e, x)
                s += a[0, 0].float()
        return s

    timed("down-projection inputs: gate and up apart", lambda: hidden_pass(False))
    timed("down-projection inputs: stacked (forge)", lambda: hidden_pass(True))
    x0 = xs.cpu()
    timed("routed output: forge", lambda: cal._routed_output(routed, xs, idx, wts, dev, None))
    ours = xs[:65536].float()
    xs.copy_(x0)
    routed.output = reference_output.__get__(routed)
    timed("routed output: reference formulation", lambda: cal._routed_output(routed, xs, idx, wts, dev, None))
    rows["max relative difference (first 65536 tokens)"] = float(
        (ours - xs[:65536].float()).abs().max() / xs[:65536].float().abs().max()
    )
    print(rows, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
