"""CPU benchmark of the core ops on DeepSeek-V3 shapes, each next to the same op in plain
PyTorch, run in the same process (ratios only; absolute times depend on the machine).

    python benches/bench_core_cpu.py            # full DeepSeek-V3 expert shapes
    python benches/bench_core_cpu.py --quick    # 4x smaller, for a smoke run

Ops: range grid, MSE/L^p grid search (100 candidates, p = 2.4), GPTQ (Hessian preparation +
blocked solve, B = 128), AWQ pack. Writes the table as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import forge


def timeit(fn, reps: int = 1) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----- plain PyTorch peers (the spec's formulas, vectorised) -----


def torch_range_grid(w: torch.Tensor, g: int, maxq: int = 15):
    x = w.float().reshape(w.shape[0], -1, g)
    xmin, xmax = x.amin(-1), x.amax(-1)
    s = (xmax - xmin) / maxq + 1e-9
    z = torch.clamp(torch.round(-xmin / s), 0, maxq)
    return s, z


def torch_mse_grid(w: torch.Tensor, g: int, n_grid: int = 100, shrink: float = 0.2, norm: float = 2.4):
    s0, z = torch_range_grid(w, g)
    x = w.float().reshape(w.shape[0], -1, g)
    best = torch.full_like(s0, math.inf)
    best_s = s0.clone()
    for p in torch.linspace(1 - shrink, 1 + shrink, n_grid).tolist():
        s = s0 * p
        q = torch.clamp(torch.round(x / s[..., None] + z[..., None]), 0, 15)
        loss = ((q - z[..., None]) * s[..., None] - x).abs_().pow_(norm).sum(-1)
        better = loss < best
        best = torch.where(better, loss, best)
        best_s = torch.where(better, s, best_s)
    return best_s, z


def torch_gptq(
    w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int, block: int = 128
):
    """The GPTQ authors' blocked 'fasterquant' loop (static groups), on W (N, K)."""
    w = w.clone().float()
    h = h.clone()
    n, k = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    damp = 0.01 * torch.mean(torch.diag(h))
    h += damp * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q_out = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            s, z = scale[:, col // g], zero[:, col // g]
            wc = w1[:, i]
            d = hinv1[i, i]
            q = (torch.clamp(torch.round(wc / s + z), 0, 15) - z) * s
            q_out[:, col] = q
            e = (wc - q) / d
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q_out


def torch_pack_awq(codes: torch.Tensor) -> torch.Tensor:
    k, n = codes.shape
    c = codes.to(torch.int32).reshape(k, n // 8, 8)
    out = torch.zeros(k, n // 8, dtype=torch.int32)
    for i, col in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
        out |= c[:, :, col] << (4 * i)
    return out


def bench_shape(n: int, k: int, g: int, only: set[str], add) -> None:
    w = torch.randn(n, k, dtype=torch.bfloat16)
    if "range" in only:
        add(
            "range grid",
            (n, k),
            timeit(lambda: torch_range_grid(w, g), 3),
            timeit(lambda: forge.build_quant_grid(w, g, 4, False, "range"), 3),
        )
    if "mse" in only:
        add(
            "mse grid",
            (n, k),
            timeit(lambda: torch_mse_grid(w, g)),
            timeit(lambda: forge.build_quant_grid(w, g, 4, False, "mse")),
            "100 candidates, p=2.4",
        )
    qmeta, _, _ = forge.build_quant_grid(w, g, 4, False, "range")
    codes = forge.quantize_rtn(w, qmeta, 4, g)
    if "pack" in only:
        add(
            "awq pack",
            (n, k),
            timeit(lambda: torch_pack_awq(codes), 3),
            timeit(lambda: forge.pack_awq(codes, qmeta, g), 3),
            "codes -> qweight/qzeros/scales",
        )
    if "rtn-pack" in only:
        scale, zero, _ = forge.decode_qmeta(qmeta)

        def torch_rtn_pack():
            x = w.float().reshape(n, k // g, g)
            q = torch.clamp(torch.round(x / scale[..., None] + zero.float()[..., None]), 0, 15)
            return torch_pack_awq(q.reshape(n, k).t().to(torch.uint8))

        add(
            "rtn+awq pack",
            (n, k),
            timeit(torch_rtn_pack, 3),
            timeit(lambda: forge.quantize_pack_awq(w, qmeta, g), 3),
            "fused quantize + pack (the data-free run's CPU path)",
        )
    if "gptq" not in only:
        return
    x = torch.randn(4 * k, k) @ (torch.eye(k) + 0.1 * torch.randn(k, k))
    h = (2 * x.T @ x / x.shape[0]).contiguous()
    del x
    wf = w.float()
    scale, zero, _ = forge.decode_qmeta(qmeta)
    zero = zero.float()

    def ours():
        f = forge.prepare_hessian(h, 0.01)
        forge.gptq_solve(wf.t().contiguous(), f.hinv_chol, qmeta, 4, g, 128, f.perm)

    add(
        "gptq",
        (n, k),
        timeit(lambda: torch_gptq(wf, h, scale, zero, g), 1),
        timeit(ours, 1),
        "prepare + solve, B=128",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4x smaller shapes")
    ap.add_argument("--skip-gptq", action="store_true")
    ap.add_argument("--only", default="range,mse,pack,rtn-pack,gptq", help="ops to run, comma-separated")
    ap.add_argument("--json", default=None, help="write the table here")
    args = ap.parse_args()
    torch.manual_seed(0)
    g = 128
    shapes = [(2048, 7168), (7168, 2048)]  # (N, K): routed expert gate/up, and down
    if args.quick:
        shapes = [(n // 4, k // 4) for n, k in shapes]
    rows = []

    def add(op, shape, peer, ours, note=""):
        rows.append(
            {
                "op": op,
                "shape": f"{shape[0]}x{shape[1]}",
                "torch_s": peer,
                "forge_s": ours,
                "speedup": peer / ours,
                "note": note,
            }
        )
        print(
            f"{op:12s} {shape[0]:>5d}x{shape[1]:<5d} torch {peer:9.4f}s  forge {ours:9.4f}s  "
            f"x{peer / ours:7.2f} {note}",
            flush=True,
        )

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; forge {forge.__version__}")
    for n, k in shapes:
        bench_shape(n, k, g, set(args.only.split(",")) - ({"gptq"} if args.skip_gptq else set()), add)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
