"""GPU benchmark of the CUDA kernels against peers run in the same process (ratios).

    python benches/bench_cuda.py [--json out.json] [--only gemm,dense,pack,grid,mse,gptq,prep,hessian]
                                 [--gpu-gib 79.1]  (an 80 GB card's memory on a larger one)
                                 [--shapes 4096x4096,4096x14336]  (your model's K x N)

Peers: bf16 ``X @ W.T`` (cuBLAS) and ``torch.ops.aten._weight_int4pack_mm`` (PyTorch's
int4 "tinygemm") for the W4A16 GEMM, and bf16 cuBLAS also for the runtime's dense route at
many rows (dequantize, then cuBLAS); a device-to-device copy for the fused AWQ
quantize+pack; the GPTQ authors' blocked "fasterquant" loop (one matrix) and the same loop
vectorised over experts with ``torch.bmm`` (static groups) for the GPTQ solver; a
vectorised plain-PyTorch MSE grid search; the previous chol + inverse + chol Hessian
preparation; cuBLAS ``mm(out_dtype=float32)`` for the dense Hessian and a torch loop of
gather + that ``mm`` over experts for the per-expert Hessians. DeepSeek-V3 shapes, group 128;
``--shapes`` gives the weight shapes of the gemm, dense, pack and grid rows instead (the first
two also the GPTQ rows').
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math

import gpu_budget
import torch

import forge
from forge import runtime

G = 128
SHAPES = [(7168, 2048), (2048, 7168), (7168, 18432)]  # (K, N)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"KxN,KxN"`` -> [(K, N), ...]: weight shapes as in features x out features."""
    try:
        shapes = [tuple(int(d) for d in s.strip().lower().split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected KxN[,KxN...] with positive sizes, got {text!r}")
    return shapes


def add_shapes_argument(ap: argparse.ArgumentParser) -> None:
    """``--shapes KxN,...`` (:func:`parse_shapes`; default None: :data:`SHAPES`)."""
    ap.add_argument(
        "--shapes",
        type=parse_shapes,
        default=None,
        help="weight shapes KxN, comma-separated (default: "
        + ", ".join(f"{k}x{n}" for k, n in SHAPES)
        + ", DeepSeek-V3's)",
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got − ref| / max |ref|``, in ``ref``'s dtype."""
    return float((got.to(ref.dtype) - ref).abs().max() / ref.abs().max())


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def graph_time(fn, inner: int = 20, reps: int = 10) -> float:
    """Seconds per call with the calls captured in a CUDA graph (how vLLM runs decode), so
    Python and launch overheads are out of the measurement for every contestant alike.
    Falls back to eager timing when the function cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
    except Exception as e:  # noqa: BLE001 - report and fall back
        print(f"  (graph capture failed: {type(e).__name__}: {e}; eager timing)")
        return cuda_time(fn)
    return cuda_time(g.replay, reps=reps, warmup=2) / inner


def l2_bytes() -> int:
    """The GPU's L2 cache size in bytes (50 MB on an H100 SXM)."""
    return int(
        getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
    )


def cold_graph_time(make, nbytes: int) -> float:
    """Seconds per call when the call's weights come from DRAM, as they do in a model whose
    other layers evict them from L2 between two uses. ``make(i)`` returns the call on copy
    ``i`` of the weights (``nbytes`` a copy); enough copies to fill 3× the L2 are called in
    turn inside one CUDA graph, so no call finds its weights cached by the previous ones.
    :func:`graph_time` repeats one call on one set of weights: at the expert shapes those
    (29 MB in bf16) stay in the 50 MB L2, which no decode step of a real model sees."""
    copies = max(2, math.ceil(3 * l2_bytes() / nbytes))
    fns = [make(i) for i in range(copies)]
    for fn in fns:  # every copy's first call (caches, allocations) before the capture
        fn()
    turn = itertools.cycle(fns)
    return graph_time(lambda: next(turn)(), inner=copies * math.ceil(20 / copies))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / t


def awq_weights(k: int, n: int, dtype=torch.bfloat16, group: int = G):
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, False, "range")
    return w, qmeta, forge.quantize_pack_awq(w, qmeta, group)


def tinygemm_weights(qw, qz, sc, group: int = G):
    """PyTorch's int4 tinygemm packing of the same 4-bit AWQ weights: (int4pack, scales and
    zeros (K/G, N, 2)) for ``torch.ops.aten._weight_int4pack_mm``."""
    codes, zeros = forge.unpack_awq(qw, qz, group)  # (K, N), (K/G, N) uint8
    codes = codes.t().contiguous()  # (N, K)
    w_int4 = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), 8)
    s = sc.to(torch.bfloat16)
    # tinygemm: w = (q - 8) * s + zp  ->  zp = (8 - z) * s
    return w_int4, torch.stack([s, (8 - zeros.to(torch.bfloat16)) * s], dim=-1).contiguous()


# Contestants of the cold and chain timings: (make, bytes a copy), where make(i) clones the
# weights into copy i and returns that copy's call of x.
def bf16_maker(w):
    """bf16 cuBLAS ``x @ W.T``."""

    def make(i):
        wc = w.clone()
        return lambda x: x @ wc.t()

    return make, tensor_bytes(w)


def tinygemm_maker(tiny, group: int = G):
    """PyTorch's int4 tinygemm on :func:`tinygemm_weights`' tensors."""

    def make(i):
        wc, szc = tiny[0].clone(), tiny[1].clone()
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, wc, group, szc)

    return make, tensor_bytes(*tiny)


def awq_maker(qw, qz, sc, tiled: bool = False, group: int = G):
    """Ours: ``forge.awq_matmul``, or with ``tiled`` ``runtime.awq_linear`` (its decode path,
    the tile-layout copy cached at the copy's first call)."""

    def make(i):
        c = (qw.clone(), qz.clone(), sc.clone())
        if tiled:
            cache: dict = {}
            return lambda x: runtime.awq_linear(x, *c, group, cache=cache)
        return lambda x: forge.awq_matmul(x, *c, group)

    return make, tensor_bytes(qw, qz, sc)


def tensor_bytes(*tensors) -> int:
    """Bytes the tensors hold (a call's weights: a copy's size, its share of the bandwidth)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def cold_and_chain_times(make, nbytes: int, x) -> tuple[float, float]:
    """Seconds a call of ``make(i)(x)`` (copy ``i`` of the weights, ``nbytes`` a copy) with
    the weights cold in L2 (:func:`cold_graph_time`), and in a chain: the same with each
    call's x made by a small torch kernel just before it, as a decode step's norm or
    activation makes it (that kernel's time included; a kernel that may start before its
    predecessor has finished cannot do so after one that does not signal early). Both timings
    call the same copies, made (and, for the tiled GEMV, repacked) once."""
    copy = functools.cache(make)

    def chain(i):
        f = copy(i)
        return lambda: f(x.mul(1.0))

    return cold_graph_time(lambda i: functools.partial(copy(i), x), nbytes), cold_graph_time(chain, nbytes)


def bench_gemm(rows, bw):
    for k, n in SHAPES:
        w, _, (qw, qz, sc) = awq_weights(k, n)
        w_int4, sz = tinygemm_weights(qw, qz, sc)  # tinygemm wants its own packing
        limit = tensor_bytes(qw, qz, sc) / bw
        deq_t = forge.dequantize_awq(qw, qz, sc, G).t()  # once a shape, not once an M
        for m in (1, 4, 8, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_time(lambda x=x: x @ w.t())
            t_tiny = graph_time(lambda x=x: torch.ops.aten._weight_int4pack_mm(x, w_int4, G, sz))
            ref = x.float() @ deq_t
            # (row name, seconds a call, output): the GEMM, and at decode sizes the runtime's
            # tiled GEMV on the tile-layout copy it caches
            runs = [
                (
                    "w4a16_gemm",
                    graph_time(lambda x=x: forge.awq_matmul(x, qw, qz, sc, G)),
                    forge.awq_matmul(x, qw, qz, sc, G),
                )
            ]
            cache: dict = {}
            if m <= runtime.TILED_MAX_M:
                y = runtime.awq_linear(x, qw, qz, sc, G, cache=cache)
                if "tiled" in cache:
                    t = graph_time(lambda x=x, cache=cache: runtime.awq_linear(x, qw, qz, sc, G, cache=cache))
                    runs.append(("w4a16_gemv_tiled", t, y))

            # The same calls with their weights cold in L2, and in a chain.
            contestants = {
                "bf16": bf16_maker(w),
                "tinygemm": tinygemm_maker((w_int4, sz)),
                "w4a16_gemm": awq_maker(qw, qz, sc),
            }
            if len(runs) > 1:
                contestants["w4a16_gemv_tiled"] = awq_maker(qw, qz, sc, tiled=True)
            cold, chain = {}, {}
            for name, (make, nb) in contestants.items():
                cold[name], chain[name] = cold_and_chain_times(make, nb, x)
            for op, t, y in runs:
                rows.add(
                    op,
                    f"K={k} N={n}",
                    "bf16 cuBLAS",
                    t_bf16,
                    t,
                    M=m,
                    limit_pct=100 * limit / t,
                    vs_tinygemm=t_tiny / t,
                    tinygemm_us=t_tiny * 1e6,
                    rel_err=rel_err(y, ref),
                    cold_us=cold[op] * 1e6,
                    cold_bf16_us=cold["bf16"] * 1e6,
                    cold_tinygemm_us=cold["tinygemm"] * 1e6,
                    cold_ratio=cold["bf16"] / cold[op],
                    cold_vs_tinygemm=cold["tinygemm"] / cold[op],
                    chain_us=chain[op] * 1e6,
                    chain_bf16_us=chain["bf16"] * 1e6,
                    chain_tinygemm_us=chain["tinygemm"] * 1e6,
                    chain_ratio=chain["bf16"] / chain[op],
                    chain_vs_tinygemm=chain["tinygemm"] / chain[op],
                )


def bench_dense(rows, bw):
    """Many rows (prefill, evaluation): the fused W4A16 GEMM against the runtime's dense route
    (``forge.dequantize_awq_dense`` into the activation dtype, then cuBLAS), both against bf16
    cuBLAS on the unquantized weights; and the dequantization alone against the copy
    bandwidth. Picks ``forge.runtime.DENSE_MIN_ROWS``."""
    for k, n in SHAPES:
        w, _, (qw, qz, sc) = awq_weights(k, n)
        t_deq = graph_time(lambda: forge.dequantize_awq_dense(qw, qz, sc, G, torch.bfloat16))
        nbytes = tensor_bytes(qw, qz, sc) + k * n * 2
        rows.add(
            "awq_dequant",
            f"K={k} N={n}",
            "d2d copy, same bytes",
            nbytes / bw,
            t_deq,
            limit_pct=100 * nbytes / bw / t_deq,
        )
        wd = forge.dequantize_awq_dense(qw, qz, sc, G, torch.bfloat16)
        for m in (128, 256, 512, 768, 1024, 2048, 4096, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = graph_time(lambda x=x: x @ w.t())
            t_fused = graph_time(lambda x=x: forge.awq_matmul(x, qw, qz, sc, G))
            t_dense = graph_time(lambda x=x: x @ forge.dequantize_awq_dense(qw, qz, sc, G, torch.bfloat16))
            ref = x.float() @ wd.float()
            y_dense = x @ wd  # the route's output: the same weights (deterministic), not made again
            rows.add(
                "dense_route",
                f"K={k} N={n}",
                "bf16 cuBLAS",
                t_bf16,
                t_dense,
                M=m,
                fused_us=t_fused * 1e6,
                vs_fused=t_fused / t_dense,
                dequant_us=t_deq * 1e6,
                rel_err=rel_err(y_dense, ref),
                fused_rel_err=rel_err(forge.awq_matmul(x, qw, qz, sc, G), ref),
            )
            del x, ref, y_dense


def bench_pack(rows, bw):
    """Fused RTN quantize + AWQ pack: bf16, FP8 without scales, and FP8 with DeepSeek's 128x128
    ``weight_scale_inv`` read by the kernel; the limit is the bytes moved at copy bandwidth."""
    for k, n in SHAPES:
        for dt, scaled in (
            (torch.bfloat16, False),
            (torch.float8_e4m3fn, False),
            (torch.float8_e4m3fn, True),
        ):
            w32 = torch.randn(n, k, device="cuda") * 0.02
            s = None
            if scaled:
                s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
                w32 = (w32 * 5000).clamp(-440, 440)  # DeepSeek-like: bytes spanning E4M3's range
            w = w32.to(dt)
            qmeta, _, _ = forge.build_quant_grid(w, G, 4, False, "range", scale_inv=s)

            def pack(w=w, qmeta=qmeta, s=s):
                return forge.quantize_pack_awq(w, qmeta, G, check_finite=False, scale_inv=s)

            t = graph_time(pack)
            # The kernel's own duration (CUPTI), without the gap between graph nodes that the
            # graph time includes: the bandwidth the kernel reaches while it runs.
            t_kernel = kernel_us(pack, "awq_quant_pack") * 1e-6
            moved = w.numel() * w.element_size() + qmeta.numel() + k * n // 2 + (k // G) * n * (2 + 0.5)
            moved += 0 if s is None else s.numel() * 4
            t_copy = graph_time(lambda w=w: w.clone())
            rows.add(
                "awq_quant_pack",
                f"K={k} N={n} {str(dt)[6:]}{' block scales' if scaled else ''}",
                "d2d copy of W",
                t_copy,
                t,
                limit_pct=100 * moved / t / bw,
                kernel_us=t_kernel * 1e6,
                kernel_limit_pct=100 * moved / t_kernel / bw,
            )


def kernel_us(fn, prefix: str, calls: int = 20, per_call: bool = False) -> float:
    """Mean device time (µs) of the CUDA kernels whose name starts with ``prefix`` over
    ``calls`` calls of ``fn``, from torch.profiler (CUPTI sees the NVRTC kernels too): the
    kernel alone, without the API's argument checks around it. ``per_call``: the sum of all
    such kernels per call of ``fn`` (a call that launches many) instead of the mean launch."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = [e.device_time for e in prof.events() if e.name.startswith(prefix)]
    return sum(us) / (calls if per_call else max(len(us), 1))


def bench_grid(rows, bw):
    """The range grid kernel (min/max per group) alone, bf16 and FP8 with block scales; the
    limit is its bytes moved at copy bandwidth."""
    for k, n in SHAPES:
        for dt, scaled in ((torch.bfloat16, False), (torch.float8_e4m3fn, True)):
            w32 = torch.randn(n, k, device="cuda") * 0.02
            s = None
            if scaled:
                s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
                w32 = (w32 * 5000).clamp(-440, 440)
            w = w32.to(dt)
            t = kernel_us(
                lambda w=w, s=s: forge.build_quant_grid(w, G, 4, False, "range", scale_inv=s), "qmeta_range"
            )
            t_copy = graph_time(lambda w=w: w.clone())
            moved = w.numel() * w.element_size() + n * (k // G) * 4 + (0 if s is None else s.numel() * 4)
            rows.add(
                "qmeta_range",
                f"K={k} N={n} {str(dt)[6:]}{' block scales' if scaled else ''}",
                "d2d copy of W",
                t_copy,
                t * 1e-6,
                limit_pct=100 * moved / (t * 1e-6) / bw,
            )


def bench_mse(rows):
    for k, n in SHAPES[:2]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

        def peer(w=w):
            x = w.float().reshape(n, -1, G)
            xmin, xmax = x.amin(-1), x.amax(-1)
            s0 = (xmax - xmin) / 15 + 1e-9
            z = torch.clamp(torch.round(-xmin / s0), 0, 15)
            p = torch.linspace(0.8, 1.2, 100, device="cuda")
            best = torch.full_like(s0, math.inf)
            best_s = s0.clone()
            for i in range(0, 100, 10):  # 10 candidates at a time keeps memory bounded
                s = s0[..., None] * p[i : i + 10]
                q = torch.clamp(torch.round(x[..., None, :] / s[..., None] + z[..., None, None]), 0, 15)
                loss = ((q - z[..., None, None]) * s[..., None] - x[..., None, :]).abs().pow(2.4).sum(-1)
                lv, li = loss.min(-1)
                better = lv < best
                best = torch.where(better, lv, best)
                best_s = torch.where(better, s.gather(-1, li[..., None])[..., 0], best_s)
            return best_s

        t_peer = cuda_time(peer, reps=3, warmup=1)
        t_ours = cuda_time(lambda w=w: forge.build_quant_grid(w, G, 4, False, "mse"), reps=5)
        rows.add(
            "mse_grid",
            f"K={k} N={n}",
            "torch vectorised",
            t_peer,
            t_ours,
        )


def gptq_reference_bmm(w, hinv, scale, zero, block=128):
    """The authors' fasterquant loop vectorised over E matrices with bmm (static groups).
    w (E, N, K) f32, hinv (E, K, K) upper factor, scale/zero (E, N, K/G)."""
    w = w.clone()
    e, n, k = w.shape
    q_out = torch.empty_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.empty_like(w1)
        h1 = hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = (i1 + i) // G
            s, z = scale[:, :, g], zero[:, :, g]
            wc = w1[:, :, i]
            q = (torch.clamp(torch.round(wc / s + z), 0, 15) - z) * s
            q_out[:, :, i1 + i] = q
            d = h1[:, i, i]
            ec = (wc - q) / d[:, None]
            w1[:, :, i:] -= torch.bmm(ec[:, :, None], h1[:, i : i + 1, i:])
            err1[:, :, i] = ec
        w[:, :, i2:] -= torch.bmm(err1, hinv[:, i1:i2, i2:])
    return q_out


def fitting_batch(n: int, k: int, want: int | None) -> int:
    """Experts per batched call that fit in 85 % of the free memory: per expert, the larger of
    the preparation's peak (weight, Hessian, factor and the preparation's working copy) and the
    solves' (factor, weight and its transpose, our outputs, the peer's copies)."""
    torch.cuda.empty_cache()  # blocks torch keeps cached are free for this
    free, _ = torch.cuda.mem_get_info()
    per = 4 * max(n * k + 3.2 * k * k, k * k + 6 * n * k)
    fit = max(1, int(0.85 * free // per))
    return min(want, fit) if want else min(64, fit)


def bench_gptq(rows, batch):
    for n, k in [(2048, 7168), (7168, 2048)]:  # (N, K): gate/up and down of a routed expert
        for e in (1, fitting_batch(n, k, batch)):
            w = torch.randn(e, n, k, device="cuda") * 0.02
            # Hessians of correlated inputs, one expert at a time (a batch of the inputs
            # themselves would be 2k x k each).
            h = torch.empty(e, k, k, device="cuda")
            for i in range(e):
                x = torch.randn(2 * k, k, device="cuda") @ (
                    torch.eye(k, device="cuda") + 0.05 * torch.randn(k, k, device="cuda")
                )
                torch.mm(x.T, x, out=h[i]).mul_(2 / x.shape[0])
                del x
            u, _, _, _, _ = forge.prepare_hessian_batched(h, 0.01)
            del h
            qm = torch.stack([forge.build_quant_grid(w[i], G, 4, False, "range")[0] for i in range(e)])
            sc, zr, _ = forge.decode_qmeta(qm)
            sc, zr = sc.cuda(), zr.cuda().float()
            wt = w.transpose(1, 2).contiguous()

            def ours(wt=wt, u=u, qm=qm):
                return forge.gptq_solve_batched(wt, u, qm, 4, G, 128)

            def peer(w=w, u=u, sc=sc, zr=zr):
                return gptq_reference_bmm(w, u, sc, zr)

            reps = 3 if e == 1 else 1
            t_ours = cuda_time(ours, reps=reps, warmup=1)
            t_peer = cuda_time(peer, reps=1, warmup=1)
            codes, deq = ours()
            ref = peer()
            diff = float((deq.transpose(1, 2) - ref).abs().max() / sc.max())
            flops = 2 * n * k * k * e
            label = "fasterquant loop" if e == 1 else f"bmm loop, {e} experts"
            # where the solve's time goes: the in-block kernel and the trailing products
            split = {
                f"{name}_kernel_ms": kernel_us(ours, f"gptq_{name}", calls=1, per_call=True) / 1e3
                for name in ("block", "trail")
            }
            rows.add(
                "gptq",
                f"{n}x{k} x{e}",
                label,
                t_peer,
                t_ours,
                per_matrix_ms=t_ours * 1e3 / e,
                tflops=flops / t_ours / 1e12,
                max_diff_in_scales=diff,
                **split,
            )
            del w, u, qm, wt


def prepare_peer(h, percdamp=0.01):
    """The previous preparation (kept here as the peer): Cholesky, ``cholesky_inverse``, then
    Cholesky of the inverse (upper), batched, on copies of the whole batch."""
    c = h.shape[-1]
    diag = torch.diagonal(h, dim1=1, dim2=2)
    damp = percdamp * diag.mean(1)
    hd = h + damp[:, None, None] * torch.eye(c, device=h.device)
    lo, _ = torch.linalg.cholesky_ex(hd)
    u, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(lo), upper=True)
    return u


def inverse_residual(u, h, damp):
    """``max |Uᵀ U (H + damp I) − I|`` in float64 (how well ``U`` factorises the inverse)."""
    c = h.shape[-1]
    eye = torch.eye(c, device=h.device, dtype=torch.float64)
    hd = h.double() + damp * eye
    return float(((u.double().T @ u.double()) @ hd - eye).abs().max())


def peak_extra(fn):
    """``(result, seconds, peak bytes allocated above the starting point)`` of one call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    b.synchronize()
    return out, a.elapsed_time(b) / 1e3, torch.cuda.max_memory_allocated() - base


def bench_prep(rows, batch):
    """Hessian preparation (damping, U = chol(H^-1)) per expert batch, against the previous
    three-factorisation version: time, peak extra memory in units of the batch's Hessians,
    and the inverse residual of both against float64."""
    for k, want in ((7168, 16), (2048, 64)):
        e = min(batch or want, want)
        x = torch.randn(e, 2 * k, k, device="cuda", dtype=torch.bfloat16)
        h = torch.bmm(x.transpose(1, 2), x, out_dtype=torch.float32) / x.shape[1]
        del x
        hbytes = h.numel() * 4
        # Memory and results from one call each; times the median of three after a warm-up on
        # the whole batch (a first call's cuSOLVER workspaces and batch shapes are not timed:
        # on an H100 the peer's first call took 189 ms where later ones took 124).
        # Once a process, before the memory is measured: every stream's host thread, cuSOLVER /
        # cuBLAS handles and workspaces (~40 MB a stream), as tests/test_cuda.py does.
        forge.prepare_hessian_batched(h, 0.01)
        prepare_peer(h[:1])
        (u, _, damp, _, _), _, m_ours = peak_extra(lambda h=h: forge.prepare_hessian_batched(h, 0.01))
        res_ours = inverse_residual(u[0], h[0], damp[0])
        del u
        torch.cuda.empty_cache()
        t_ours = cuda_time(lambda h=h: forge.prepare_hessian_batched(h, 0.01), reps=3, warmup=1)
        torch.cuda.empty_cache()
        up, _, m_peer = peak_extra(lambda h=h: prepare_peer(h))
        res_peer = inverse_residual(up[0], h[0], damp[0])
        del up
        torch.cuda.empty_cache()
        t_peer = cuda_time(lambda h=h: prepare_peer(h), reps=3, warmup=1)
        del h
        torch.cuda.empty_cache()
        rows.add(
            "prepare_hessian",
            f"K={k} x{e}",
            "chol+inverse+chol",
            t_peer,
            t_ours,
            per_matrix_ms=t_ours * 1e3 / e,
            extra_mem_x_hessians=m_ours / hbytes,
            peer_extra_mem_x_hessians=m_peer / hbytes,
            inverse_residual=res_ours,
            peer_inverse_residual=res_peer,
        )


def bench_hessian(rows):
    """Hessians ``XᵀX`` in fp32 from bf16 inputs: forge's tensor-core kernel
    (``forge.hessian_update``, upper tiles only) against one cuBLAS ``mm(out_dtype=float32)``
    for o_proj's input (D=16384); per-expert Hessians of a layer's routed tokens in ONE
    ``forge.hessian_update_segmented`` launch (rows read by index, no gathered copy), adding
    into existing Hessians and (``overwrite``) writing fresh ones as the peer does, against a
    torch loop over experts of gather + ``mm(out_dtype=float32)``, the same loop adding into the
    Hessians with ``addmm`` (the adding mode's like-for-like peer), and the run's own per-expert
    :func:`forge.calibrate.gram` loop; ``gram`` alone against one cuBLAS product at the row
    counts an expert's chunk has. Errors: max |H − H64| / max |H64| against float64 (the
    largest expert for the segmented rows)."""
    from forge.calibrate import gram

    xd = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    hd = torch.zeros(16384, 16384, device="cuda")

    def dense(hd=hd, xd=xd):
        hd.zero_()
        return forge.hessian_update(hd, xd, 1.0)

    # Timed as the run uses it, accumulating into an existing H (the peer writes a fresh
    # product and is not charged the accumulation); the error from a zeroed H.
    t_peer = cuda_time(lambda xd=xd: torch.mm(xd.t(), xd, out_dtype=torch.float32), reps=5)
    t_gram = cuda_time(lambda xd=xd: gram(xd), reps=5)
    t_ours = cuda_time(lambda hd=hd, xd=xd: forge.hessian_update(hd, xd, 1.0), reps=5)
    # The fp32 SIMT kernel (forge's path for float32 inputs; 16-bit inputs ran on it before the
    # tensor-core kernel) on a float32 copy of the same values.
    xf = xd[:4096].float()
    t_simt = cuda_time(lambda hd=hd, xf=xf: forge.hessian_update(hd, xf, 1.0), reps=2, warmup=1) * 4
    del xf
    ref = xd[:, :512].double().T @ xd[:, :512].double()
    err = rel_err(dense()[:512, :512], ref)
    err_peer = rel_err(torch.mm(xd[:, :512].t(), xd[:, :512], out_dtype=torch.float32), ref)
    flops = 2 * 16384**3
    rows.add(
        "hessian_dense",
        "D=16384 T=16384",
        "cuBLAS mm fp32 out",
        t_peer,
        t_ours,
        gram_us=t_gram * 1e6,
        simt_f32_us=t_simt * 1e6,
        tflops=flops / t_ours / 1e12,
        rel_err_vs_f64=err,
        peer_rel_err_vs_f64=err_peer,
    )
    del xd, hd
    # The run's per-chunk Hessian: gram (one product, or the upper row panels from
    # SYMMETRIC_ROWS rows) against one cuBLAS product, over the row counts an expert sees.
    for d in (7168, 2048, 16384):
        for t in (2048, 8192, 65536):
            torch.cuda.empty_cache()
            x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            t_peer = cuda_time(lambda x=x: torch.mm(x.t(), x, out_dtype=torch.float32), reps=5)
            t_ours = cuda_time(lambda x=x: gram(x), reps=5)
            # forge's own kernel on the same chunk (accumulating into an H), for the run's choice.
            hk = torch.zeros(d, d, device="cuda")
            t_kernel = cuda_time(lambda x=x, hk=hk: forge.hessian_update(hk, x, 1.0), reps=5)
            ref = x[:, :256].double().T @ x[:, :256].double()
            err = rel_err(gram(x)[:256, :256], ref)
            rows.add(
                "hessian_gram",
                f"D={d} T={t}",
                "cuBLAS mm fp32 out",
                t_peer,
                t_ours,
                hessian_update_us=t_kernel * 1e6,
                rel_err_vs_f64=err,
            )
            del x, hk
    for e, top_k, t, d in ((64, 8, 32768, 7168), (64, 8, 131072, 7168), (256, 8, 65536, 2048)):
        torch.cuda.empty_cache()
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        # Skewed routing (a per-expert bias), as in bench_gptq_layer.
        logits = torch.randn(t, e, device="cuda") + 1.5 * torch.randn(e, device="cuda")
        idx = logits.topk(top_k, dim=-1).indices.reshape(-1)
        order = torch.argsort(idx, stable=True)
        counts = torch.bincount(idx, minlength=e)
        tok = order // top_k
        tok32 = tok.to(torch.int32)
        offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = counts.cumsum(0)
        cl = counts.tolist()
        h = torch.empty(e, d, d, device="cuda")

        def loop(per_expert, x=x, tok=tok, cl=cl):
            """``per_expert(e, xe)`` for each expert ``e`` and its gathered rows ``xe``."""
            xs = x[tok]
            out, start = [], 0
            for i, c in enumerate(cl):
                out.append(per_expert(i, xs[start : start + c]))
                start += c
            return out

        def ours(h=h, x=x, tok32=tok32, offsets=offsets):
            h.zero_()
            return forge.hessian_update_segmented(h, x, tok32, offsets, 1.0)

        peer = lambda: loop(lambda _, xe: torch.mm(xe.t(), xe, out_dtype=torch.float32))  # noqa: E731
        t_peer = cuda_time(peer, reps=3, warmup=1)
        # The adding mode's like-for-like peer: the same loop adding each expert's product into
        # its Hessian in place (cuBLAS addmm, beta = 1, fp32 out), as a run that accumulates
        # chunk by chunk would have to. Checked against forge's adding mode on zeroed Hessians.
        add_peer = lambda h=h: loop(  # noqa: E731
            lambda i, xe: torch.addmm(h[i], xe.t(), xe, out_dtype=torch.float32, out=h[i])
        )
        e0 = int(counts.argmax())
        h.zero_()
        add_peer()
        peer_add_e0 = h[e0].clone()
        t_peer_add = cuda_time(add_peer, reps=3, warmup=0)  # the checked call above warmed it
        t_gram = cuda_time(lambda: loop(lambda _, xe: gram(xe)), reps=3, warmup=1)
        # Accumulating, as dense above (zeroing 64 Hessians of 7168² is 4 ms on its own); the
        # offsets and the indices' range are checked on every call (two host syncs), the
        # NaN/Inf pass over all of x only by default (timed apart: the run checks otherwise).
        t_ours = cuda_time(
            lambda h=h, x=x, tok32=tok32, offsets=offsets: forge.hessian_update_segmented(
                h, x, tok32, offsets, 1.0, check_finite=False
            ),
            reps=3,
            warmup=1,
        )
        t_checked = cuda_time(
            lambda h=h, x=x, tok32=tok32, offsets=offsets: forge.hessian_update_segmented(
                h, x, tok32, offsets, 1.0
            ),
            reps=3,
            warmup=1,
        )
        # Fresh products (``overwrite``): what the peer computes, H written and never read.
        t_fresh = cuda_time(
            lambda h=h, x=x, tok32=tok32, offsets=offsets: forge.hessian_update_segmented(
                h, x, tok32, offsets, 1.0, check_finite=False, overwrite=True
            ),
            reps=3,
            warmup=1,
        )
        xe = x[tok[int(counts[:e0].sum()) : int(counts[: e0 + 1].sum())]]
        ref = xe.double().T @ xe.double()
        err = rel_err(ours()[e0], ref)
        # Both added into zeros: the accumulating peer's largest expert against forge's.
        peer_add_vs_ours = rel_err(peer_add_e0, h[e0])
        peer_add_err = rel_err(peer_add_e0, ref)
        del peer_add_e0
        err_peer = rel_err(torch.mm(xe.t(), xe, out_dtype=torch.float32), ref)
        rows.add(
            "hessian_experts",
            f"D={d} {e} experts, {t}x{top_k} rows",
            "gather + torch mm loop",
            t_peer,
            t_ours,
            gram_loop_us=t_gram * 1e6,
            with_finite_check_us=t_checked * 1e6,
            overwrite_us=t_fresh * 1e6,
            overwrite_ratio=t_peer / t_fresh,
            adding_peer_us=t_peer_add * 1e6,
            adding_ratio=t_peer_add / t_ours,
            adding_peer_vs_ours=peer_add_vs_ours,
            adding_peer_rel_err_vs_f64=peer_add_err,
            tflops=2 * t * top_k * d * d / t_ours / 1e12,
            rel_err_vs_f64=err,
            peer_rel_err_vs_f64=err_peer,
        )
        del x, h


def print_row(r):
    extra = ""
    if "limit_pct" in r:
        extra += f"  {r['limit_pct']:5.1f}% of limit"
    if "kernel_limit_pct" in r:
        extra += f" (kernel alone {r['kernel_us']:.1f}us, {r['kernel_limit_pct']:.1f}%)"
    if "vs_fused" in r:
        extra += f"  fused w4a16_gemm {r['fused_us']:.1f}us: dense route x{r['vs_fused']:.2f} vs fused"
    if "vs_tinygemm" in r:
        extra += f"  x{r['vs_tinygemm']:.2f} vs tinygemm"
    if "cold_us" in r:
        extra += (
            f"  | L2-cold: ours {r['cold_us']:.1f}us bf16 {r['cold_bf16_us']:.1f}us x{r['cold_ratio']:.2f},"
            f" x{r['cold_vs_tinygemm']:.2f} vs tinygemm"
        )
    if "chain_us" in r:
        extra += (
            f"  | chain: ours {r['chain_us']:.1f}us bf16 {r['chain_bf16_us']:.1f}us x{r['chain_ratio']:.2f},"
            f" x{r['chain_vs_tinygemm']:.2f} vs tinygemm"
        )
    if "per_matrix_ms" in r:
        extra += f"  {r['per_matrix_ms']:.2f} ms/matrix"
    if "tflops" in r:
        extra += f" {r['tflops']:.1f} TFLOP/s"
    if "overwrite_us" in r:
        extra += f"  | fresh (overwrite) {r['overwrite_us']:.0f}us x{r['overwrite_ratio']:.2f}"
    if "adding_peer_us" in r:
        extra += f"  | adding vs addmm loop {r['adding_peer_us']:.0f}us x{r['adding_ratio']:.2f}"
    if "hessian_update_us" in r:
        extra += f"  (forge.hessian_update {r['hessian_update_us']:.1f}us)"
    if "block_kernel_ms" in r:
        extra += f" (in-block kernels {r['block_kernel_ms']:.1f} ms, trailing {r['trail_kernel_ms']:.1f} ms)"
    if "extra_mem_x_hessians" in r:
        extra += (
            f"  extra memory {r['extra_mem_x_hessians']:.2f}x H (peer {r['peer_extra_mem_x_hessians']:.2f}x)"
        )
    if "rel_err_vs_f64" in r:
        extra += f"  rel err {r['rel_err_vs_f64']:.1e}"
        if "peer_rel_err_vs_f64" in r:
            extra += f" (peer {r['peer_rel_err_vs_f64']:.1e})"
    print(
        f"{r['op']:15s} {r['shape']:22s} M={str(r['M']):>4s} {r['peer']:22s} {r['peer_us']:10.1f}us "
        f"ours {r['ours_us']:10.1f}us  x{r['ratio']:6.2f}{extra}",
        flush=True,
    )


def main() -> None:
    global SHAPES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="gemm,dense,pack,grid,mse,gptq,prep,hessian")
    ap.add_argument(
        "--batch", type=int, default=None, help="experts per batched GPTQ call (default: 64, or what fits)"
    )
    add_shapes_argument(ap)
    gpu_budget.add_argument(ap)
    args = ap.parse_args()
    if args.shapes:
        SHAPES = args.shapes
    st = forge.cuda_status()
    print(st)
    if not st["available"]:
        raise SystemExit(f"CUDA not available: {st['reason']}")
    gpu_budget.hold_beyond(args.gpu_gib)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, d2d copy {bw / 1e12:.2f} TB/s (read + write)")
    rows = Rows(args.json, dict(device=torch.cuda.get_device_name(), copy_bw=bw, gpu_budget_gib=args.gpu_gib))
    only = set(args.only.split(","))
    if "gemm" in only:
        bench_gemm(rows, bw)
    if "dense" in only:
        bench_dense(rows, bw)
    if "pack" in only:
        bench_pack(rows, bw)
    if "grid" in only:
        bench_grid(rows, bw)
    if "mse" in only:
        bench_mse(rows)
    if "gptq" in only:
        bench_gptq(rows, args.batch)
    if "prep" in only:
        bench_prep(rows, args.batch)
    if "hessian" in only:
        bench_hessian(rows)


class Rows(list):
    """Result rows, written to the JSON file as each arrives (a crash keeps what was measured)."""

    def __init__(self, path, head):
        super().__init__()
        self.path, self.head = path, head

    def append(self, row):
        super().append(row)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(dict(self.head, rows=list(self)), f, indent=2)

    def add(self, op, shape, peer, t_peer, t_ours, M="-", **extra):
        """One row: ``op`` on ``shape`` against ``peer`` (times in seconds, stored in µs, and
        the peer-to-ours ratio) plus ``extra`` fields; written and printed."""
        row = dict(
            op=op,
            shape=shape,
            M=M,
            peer=peer,
            peer_us=t_peer * 1e6,
            ours_us=t_ours * 1e6,
            ratio=t_peer / t_ours,
            **extra,
        )
        self.append(row)
        print_row(row)


if __name__ == "__main__":
    main()
