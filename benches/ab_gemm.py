"""A/B timing of ``forge.awq_matmul`` (W4A16 GEMM) for comparing kernel variants run by
separate processes: JSON lines on stdout, one per (shape, M), warm and with the weights cold in
L2, optionally beside bf16 cuBLAS on the same weights.

    python benches/ab_gemm.py TAG [--ms 32,64,128] [--peers] [--reps 2]

The variants differ by environment, read once per process: ``FORGE_CUDA_SRC=dir`` (kernel
sources from ``dir``, e.g. the previous ``cuda/gemm.cu`` and ``common.cuh``; give each variant
its own ``FORGE_KERNEL_CACHE``) and the tuning knobs of crates/forge-cuda/README.md
("Development aids": ``FORGE_GEMM_WG_SPLITS``, ...). For example, the kept kernel beside a
candidate, two runs each:

    for r in 1 2; do
      FORGE_CUDA_SRC=old FORGE_KERNEL_CACHE=/tmp/kc_old python benches/ab_gemm.py old_$r --peers
      FORGE_KERNEL_CACHE=/tmp/kc_new python benches/ab_gemm.py new_$r
    done

Each row holds ``warm_us`` (one weight set, graph time), ``cold_us`` (copies filling 3x the
L2 called in turn), the worst error over its tolerance against the float64 product of the
dequantized weights (``err_tol`` < 1 passes) and ``ysum`` (the output's sum: equal between
variants that sum in the same order). Times are the lower of ``--reps`` measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import forge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import SHAPES, G, awq_weights, cold_graph_time, graph_time  # noqa: E402


def time_shape(tag: str, k: int, n: int, ms: list[int], peers: bool, reps: int) -> None:
    """Prints the rows of one weight shape ``(K, N)``."""
    w, _, (qw, qz, sc) = awq_weights(k, n)
    deq = forge.dequantize_awq(qw, qz, sc, G).double()
    nbytes = qw.numel() * 4 + qz.numel() * 4 + sc.numel() * 2

    def best(fn) -> float:
        return min(fn() for _ in range(reps)) * 1e6

    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = forge.awq_matmul(x, qw, qz, sc, G)
        ref = x.double() @ deq.t()
        # bf16: the weights rounded to bf16 and the output rounding (as the GPU tests)
        tol = 2**-7 * (x.double().abs() @ deq.abs().t()) + 2**-7 * ref.abs()
        row = {
            "tag": tag,
            "k": k,
            "n": n,
            "m": m,
            "err_tol": float(((y.double() - ref).abs() / tol).max()),
            "ysum": float(y.double().sum()),
        }

        def ours_on_copy(i, x=x):
            c = (qw.clone(), qz.clone(), sc.clone())
            return lambda: forge.awq_matmul(x, *c, G)

        def bf16_on_copy(i, x=x):
            a = w.clone()
            return lambda: x @ a.t()

        row["warm_us"] = best(lambda x=x: graph_time(lambda: forge.awq_matmul(x, qw, qz, sc, G)))
        row["cold_us"] = best(lambda: cold_graph_time(ours_on_copy, nbytes))
        if peers:
            row["bf16_warm_us"] = best(lambda x=x: graph_time(lambda: x @ w.t()))
            row["bf16_cold_us"] = best(lambda: cold_graph_time(bf16_on_copy, w.numel() * 2))
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", help="the variant's name, copied into every row")
    ap.add_argument("--ms", default="32,64,128", help="activation rows M, comma-separated")
    ap.add_argument("--peers", action="store_true", help="also time bf16 cuBLAS on the same weights")
    ap.add_argument("--reps", type=int, default=2, help="measurements per time (the lowest is kept)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    torch.manual_seed(0)
    for k, n in SHAPES:
        time_shape(args.tag, k, n, ms, args.peers, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
