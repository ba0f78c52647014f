"""A/B timing of ``forge.awq_matmul`` (W4A16 GEMM), or with ``--tiled`` of the runtime's decode
path (``runtime.awq_linear``: the tiled GEMV, M <= 16), for comparing kernel variants run by
separate processes: JSON lines on stdout, one per (shape, M), warm and with the weights cold in
L2, optionally beside bf16 cuBLAS (and with ``--tiled`` PyTorch's int4 tinygemm) on the same
weights.

    python benches/ab_gemm.py TAG [--ms 32,64,128] [--shapes 7168x2048,...] [--tiled] [--peers] [--group 128] [--reps 2]

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
L2 called in turn), ``chain_us`` (as cold, but each call's x made by a small torch kernel just
before it, as a decode step's previous op makes it: that kernel's time is included, for the
peers alike, and a GEMV cannot start before it the way it can overlap another GEMV), the worst error over its tolerance against the float64 product of the
dequantized weights (``err_tol`` < 1 passes) and ``ysum`` (the output's sum: equal between
variants that sum in the same order), and ``workspace_bytes`` (the plan's split-K workspace: 0 when
K is not split or is split within a thread block cluster). Times are the lower of ``--reps`` measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import forge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import (  # noqa: E402
    SHAPES,
    G,
    add_shapes_argument,
    awq_maker,
    awq_weights,
    bf16_maker,
    cold_and_chain_times,
    graph_time,
    tinygemm_maker,
    tinygemm_weights,
)

from forge import runtime  # noqa: E402


def time_shape(
    tag: str, k: int, n: int, ms: list[int], tiled: bool, peers: bool, reps: int, group: int
) -> None:
    """Prints the rows of one weight shape ``(K, N)`` at the group size ``group``."""
    w, _, (qw, qz, sc) = awq_weights(k, n, group=group)
    deq = forge.dequantize_awq(qw, qz, sc, group).double()
    tiny = tinygemm_weights(qw, qz, sc, group) if tiled and peers else None

    def best(fn) -> float:
        return min(fn() for _ in range(reps)) * 1e6

    plan = getattr(forge._native, "w4a16_plan", None)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cache: dict = {}
        y = (
            runtime.awq_linear(x, qw, qz, sc, group, cache=cache)
            if tiled
            else forge.awq_matmul(x, qw, qz, sc, group)
        )
        if tiled and "tiled" not in cache:
            raise SystemExit(f"the tiled GEMV does not take M = {m} at {k}x{n}")
        ref = x.double() @ deq.t()
        # bf16: the weights rounded to bf16 and the output rounding (as the GPU tests)
        tol = 2**-7 * (x.double().abs() @ deq.abs().t()) + 2**-7 * ref.abs()
        row = {
            "tag": tag,
            "k": k,
            "n": n,
            "m": m,
            "g": group,
            "err_tol": float(((y.double() - ref).abs() / tol).max()),
            "ysum": float(y.double().sum()),
            # the plan's split-K workspace (0: K not split, or split within a cluster)
            "workspace_bytes": forge._native.w4a16_workspace_bytes(x.device.index or 0, m, n, k, group),
            # the kernel, grid and K splits launched (None from wheels older than the query)
            "plan": plan(x.device.index or 0, True, m, n, k, group) if plan else None,
        }

        contestants = {"": awq_maker(qw, qz, sc, tiled, group)}
        if peers:
            contestants["bf16_"] = bf16_maker(w)
        if tiny is not None:
            contestants["tinygemm_"] = tinygemm_maker(tiny, group)
        for name, (make, nb) in contestants.items():
            call = make(0)
            row[f"{name}warm_us"] = best(lambda x=x, call=call: graph_time(lambda: call(x)))
            times = [cold_and_chain_times(make, nb, x) for _ in range(reps)]
            row[f"{name}cold_us"] = min(c for c, _ in times) * 1e6
            row[f"{name}chain_us"] = min(c for _, c in times) * 1e6
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", help="the variant's name, copied into every row")
    ap.add_argument("--ms", default="32,64,128", help="activation rows M, comma-separated")
    ap.add_argument("--tiled", action="store_true", help="time runtime.awq_linear's tiled GEMV (M <= 16)")
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also time bf16 cuBLAS (with --tiled: and tinygemm) on the same weights",
    )
    ap.add_argument("--group", type=int, default=G, help="quantization group size G (default %(default)s)")
    ap.add_argument("--reps", type=int, default=2, help="measurements per time (the lowest is kept)")
    add_shapes_argument(ap)
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = args.shapes or SHAPES
    torch.manual_seed(0)
    for k, n in shapes:
        time_shape(args.tag, k, n, ms, args.tiled, args.peers, args.reps, args.group)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
