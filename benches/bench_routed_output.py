"""GPU benchmark of the calibration's expert passes at DeepSeek-V3 scale against the formulation
they replaced, run in the same process: the routed output of every calibration token
(``forge.calibrate._routed_output``: on Hopper two grouped GEMMs per window over the pairs
sorted by expert, the router weight folded into the down-projection input, each token's rows
summed by ``embedding_bag``) against the per-expert loop (one GEMM pair per expert and window,
fp32 outputs scattered with ``index_add_``); and the down-projection inputs of every routed pair
(what the down Hessians read), one stacked GEMM against two.

    python benches/bench_routed_output.py [--tokens 2097152] [--json out.json]

256 experts (7168 -> 2048 -> 7168, bf16), top-8 routing drawn from a skewed (Zipf 0.7)
expert popularity. Needs about 60 GB of GPU memory at 2M tokens (plus a host copy). Accuracy:
both paths on the first 4096 tokens against a float32 computation of the same bf16 inputs,
as ``max |out - ref| / max |ref|``.
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
    gu = self.gate_up[e]
    return self.act(F.linear(x, gu[:INTER])) * F.linear(x, gu[INTER:])


def float32_output(routed, x, idx, wts) -> torch.Tensor:
    """The routed output computed token by token in float32 from the same bf16 values."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            rows = (idx[:, j] == e).nonzero()[:, 0]
            h = xf[rows] @ routed.gate_up[e].float().t()
            a = routed.act(h[:, :INTER]) * h[:, INTER:]
            out[rows] += wts[rows, j, None].float() * (a @ routed.down[e].float().t())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2097152)
    ap.add_argument("--json", help="write the rows here (after each row, so a failure keeps them)")
    ap.add_argument("--profile", help="write torch.profiler's table of one window of forge's pass here")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    gate_up = torch.randn(E, 2 * INTER, D, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, D, INTER, device=dev, dtype=torch.bfloat16) * 0.02
    routed = cal._RoutedExperts(gate_up, down, F.silu)
    t = args.tokens
    xs = torch.randn(t, D, device=dev, dtype=torch.bfloat16)
    p = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 0.7)[torch.randperm(E)]
    gumbel = -torch.log(-torch.log(torch.rand(t, E, device=dev)))
    idx = torch.topk(torch.log(p.float().to(dev)) + gumbel, K, dim=1).indices
    del gumbel
    wts = torch.softmax(torch.randn(t, K, device=dev), 1)
    rows: dict[str, object] = {"device": torch.cuda.get_device_name(), "tokens": t}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

    def timed(name, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rows[name] = time.perf_counter() - t0
        print(f"{name:52s} {rows[name]:7.3f} s", flush=True)
        save()

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

    n = 4096
    ref = float32_output(routed, xs[:n], idx[:n], wts[:n])
    for name, fn in (
        ("grouped (forge)", routed._compute_grouped),
        ("per expert", routed._compute_per_expert),
    ):
        err = (fn(xs[:n], idx[:n], wts[:n]).float() - ref).abs().max() / ref.abs().max()
        rows[f"max relative error vs float32, {name}"] = float(err)
        print(f"max relative error vs float32, {name}: {float(err):.2e}", flush=True)
    save()

    x0 = xs.cpu()
    grouped = routed.grouped(dev, xs.dtype)
    rows["grouped GEMMs available"] = grouped
    timed(
        f"routed output: forge ({'grouped' if grouped else 'per expert'})",
        lambda: cal._routed_output(routed, xs, idx, wts, dev, None),
    )
    ours = xs[:65536].float()
    xs.copy_(x0)

    def per_expert():
        for w0 in range(0, t, cal.OUTPUT_WINDOW):
            w = slice(w0, w0 + cal.OUTPUT_WINDOW)
            xs[w].copy_(routed._compute_per_expert(xs[w], idx[w], wts[w]))

    timed("routed output: per expert (fp32 index_add_)", per_expert)
    rows["max relative difference of the two (first 65536 tokens)"] = float(
        (ours - xs[:65536].float()).abs().max() / xs[:65536].float().abs().max()
    )
    print(json.dumps(rows, indent=1), flush=True)
    save()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        w = slice(0, cal.GROUPED_WINDOW if grouped else cal.OUTPUT_WINDOW)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            routed.compute(xs[w], idx[w], wts[w])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        Path(args.profile).write_text(table)
        print(table, flush=True)


if __name__ == "__main__":
    main()
