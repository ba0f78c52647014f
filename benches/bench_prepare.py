"""GPU benchmark of the Hessian preparation's settings: CUDA streams and the triangular
inverse's leaf size (``forge.quant.PREPARE_STREAMS``, ``forge.quant.TRI_LEAF``), per matrix,
with the extra peak memory in units of the batch's Hessians and whether the factors are the
same floats as one stream's (they must be, for equal leaves).

    python benches/bench_prepare.py [--json out.json]

DeepSeek-V3 shapes: 32 expert gate/up Hessians (7168²), 64 down Hessians (2048²), attention's
o_proj input (16384², 2 matrices). Inputs are ``XᵀX / T`` of random bf16 ``X (2C, C)``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forge.quant as q

SETTINGS = ((1, 128), (4, 64), (4, 128), (4, 256), (8, 128))  # (streams, TRI_LEAF)
SHAPES = ((32, 7168), (64, 2048), (2, 16384))  # (matrices, C)


def hessians(e: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.empty(e, n, n, device="cuda")
    for i in range(e):
        x = torch.randn(2 * n, n, device="cuda", generator=g, dtype=torch.bfloat16)
        h[i] = torch.mm(x.t(), x, out_dtype=torch.float32) / (2 * n)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here (after each row, so a failure keeps them)")
    args = ap.parse_args()
    out = {}
    for e, n in SHAPES:
        h = hessians(e, n, 0)
        ref = None
        for streams, leaf in SETTINGS:
            q.PREPARE_STREAMS, q.TRI_LEAF = streams, leaf
            q.prepare_hessian_batched(h[:2])  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            u = q.prepare_hessian_batched(h)[0]
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_allocated() - base) / h.nbytes
            same = None if ref is None else bool(torch.equal(u, ref))
            if ref is None:
                ref = u
            print(
                f"E={e} C={n} streams={streams} leaf={q._tri_leaf(n)}: {dt * 1e3 / e:.2f} ms/matrix, "
                f"extra peak {peak:.2f}x batch, identical to 1 stream: {same}",
                flush=True,
            )
            out[f"{e}x{n} s{streams} leaf{leaf}"] = {
                "ms_per_matrix": dt * 1e3 / e,
                "peak_x": peak,
                "identical": same,
            }
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        del h, u, ref


if __name__ == "__main__":
    main()
