"""Seeded random sweeps of the W4A16 entry points over shapes no other test picks (marker
``cuda``; skipped without a usable GPU).

The other CUDA tests pin each kernel on a handful of chosen shapes. The dispatch in front of
them (GEMVs by M and N, the wgmma GEMM's token tiles, K splits and clusters, the mma.sync GEMM,
the dense route, the grouped MoE forms and their fallbacks) branches on M, K, N, G, the number
of experts and the routing, so a model nobody tested can reach a branch on a shape no chosen
case covers. Each sweep draws its cases from a fixed seed (the same cases every run) and
checks every one against a plain-torch reference written here:

* ``forge.awq_matmul`` and ``AwqLinear``: each output within the kernels' stated bound,
  ``|y − ref| ≤ u·Σ_k |x_k·w_kn| + u·|ref|`` with ``u`` = 2⁻¹⁰ (float16) or 2⁻⁷ (bfloat16),
  ``ref`` the float64 product of the 16-bit activations and the weights as the kernels take
  them (``(q − z)·s`` rounded once to the activation type); the dense route (from
  :data:`forge.runtime.DENSE_MIN_ROWS` rows, and at any M for out features that are not a
  multiple of 32, which the fused kernels do not take) is a cuBLAS product, held to twice that.
* ``AwqExperts``: ``max |y − ref| / max |ref|`` below 8e-3 (float16) / 4e-2 (bfloat16), the
  bounds of ``test_runtime_cuda.py``'s grouped tests (each projection's output and
  ``act(gate)·up`` are rounded to the 16-bit type), ``ref`` in float32 from the dequantized
  weights, expert by expert.

A failing case names its draw, so it can be rerun alone.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_runtime import kernel_weight, random_awq

import forge
from forge import runtime
from forge.runtime import AwqExperts, AwqLinear

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and forge.cuda_status()["available"]),
        reason="needs an NVIDIA GPU with a CUDA driver",
    ),
]

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
MOE_TOL = {torch.float16: 8e-3, torch.bfloat16: 4e-2}

# M buckets: the GEMVs (1, 2-4, 5-8, 9-16), the wgmma GEMM's 16 / 32 / 64 / 128 / 256-token
# tiles and their partial last blocks, several M blocks; the dense route is drawn separately.
M_BUCKETS = (
    (1, 1),
    (2, 4),
    (5, 8),
    (9, 16),
    (17, 32),
    (33, 64),
    (65, 128),
    (129, 256),
    (257, 700),
    (701, 2100),
)
GROUPS = (32, 64, 96, 128, 128, 128, 256)


def draw_linear(rng: random.Random, m_range: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """(M, K, N, G): K a multiple of G up to 8192, N a multiple of 8 up to 12288 (half of them
    multiples of 128, as real projections are), at most 4e10 multiply-adds."""
    g = rng.choice(GROUPS)
    k = g * rng.randint(1, 8192 // g)
    kind = rng.random()
    if kind < 0.5:
        n = 128 * rng.randint(1, 96)
    elif kind < 0.75:
        n = 32 * rng.randint(1, 256)
    else:
        n = 8 * rng.randint(1, 512)
    lo, hi = m_range or rng.choice(M_BUCKETS)
    m = rng.randint(lo, hi)
    while m * k * n > 4e10 and m > 1:
        m //= 2
    return m, k, n, g


def check_within_bound(x, y, qweight, qzeros, scales, g, what: str, slack: float = 1.0) -> None:
    """``y`` against the float64 product of ``x`` and the weights as the kernels take them,
    output by output within ``slack`` times the stated bound."""
    act = x.dtype
    w = kernel_weight(qweight, qzeros, scales, g, act).double()  # (K, N)
    xd = x.double()
    ref = xd @ w
    mag = xd.abs() @ w.abs()
    assert y.dtype == act and y.shape == ref.shape, what
    bound = slack * ULP[act] * (mag + ref.abs())
    excess = (y.double() - ref).abs() - bound
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0.0, (
        f"{what}: output {divmod(worst, ref.shape[1])} off by "
        f"{float((y.double() - ref).abs().view(-1)[worst]):.3g}, bound {float(bound.view(-1)[worst]):.3g}"
    )


def slack(m: int, n: int) -> float:
    """The bound's factor: 2 where the product is cuBLAS's (the dense route: many rows, or out
    features the fused kernels do not take), 1 for forge's kernels."""
    return 2.0 if not runtime.fused_takes(n) or m >= runtime.DENSE_MIN_ROWS else 1.0


def awq_case(m: int, k: int, n: int, g: int, act: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qweight, qzeros, scales = random_awq(k, n, g, gen=gen)
    x = torch.randn(m, k, generator=gen).to(act)
    return x.cuda(), qweight.cuda(), qzeros.cuda(), scales.cuda()


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_awq_matmul_random_shapes(act):
    """forge.awq_matmul on 60 random (M, K, N, G) a dtype (seeded), every output within the
    stated bound."""
    rng = random.Random(4900 + (act == torch.bfloat16))
    for i in range(60):
        m, k, n, g = draw_linear(rng)
        x, qw, qz, sc = awq_case(m, k, n, g, act, seed=i)
        y = forge.awq_matmul(x, qw, qz, sc, g)
        check_within_bound(x, y, qw, qz, sc, g, f"draw {i}: M={m} K={k} N={n} G={g} {act}", slack(m, n))


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_awq_linear_random_shapes(act):
    """AwqLinear (eager: the tiled GEMV on its tile-layout copy up to TILED_MAX_M rows, the
    fused GEMM past it, the dense route from DENSE_MIN_ROWS) on 40 random shapes a dtype, each
    called twice (the second call reads the cached copies), within the stated bound; 3-D
    activations on a quarter of them."""
    rng = random.Random(4910 + (act == torch.bfloat16))
    for i in range(40):
        dense = i % 8 == 7
        m, k, n, g = draw_linear(
            rng, (runtime.DENSE_MIN_ROWS, runtime.DENSE_MIN_ROWS + 700) if dense else None
        )
        if dense:
            n = min(n, 4096)  # keep the product small; the route depends on the rows
            m = max(m, runtime.DENSE_MIN_ROWS)
        x, qw, qz, sc = awq_case(m, k, n, g, act, seed=100 + i)
        layer = AwqLinear.from_tensors(qw, qz, sc, g)
        xin = x.view(2, m // 2, k) if i % 4 == 1 and m % 2 == 0 else x
        what = f"draw {i}: M={m} K={k} N={n} G={g} {act}"
        for call in range(2):
            y = layer(xin).reshape(m, n)
            check_within_bound(x, y, qw, qz, sc, g, f"{what}, call {call}", slack(m, n))


def random_moe(rng: random.Random, act: torch.dtype, seed: int):
    """An AwqExperts of random size (E, hidden, intermediate, G) with random AWQ tensors."""
    g = rng.choice((32, 64, 128))
    e = rng.choice((1, 2, 3, 8, 16, 60, 64))
    hidden = g * rng.randint(1, 2048 // g)
    inter = g * rng.randint(1, 1536 // g)
    mod = AwqExperts(e, hidden, inter, g, "silu", dtype=act)
    gen = torch.Generator().manual_seed(seed)
    for prefix, (k, n) in (("gate_up", (hidden, 2 * inter)), ("down", (inter, hidden))):
        qweight, qzeros, scales = random_awq(k, n, g, e, gen=gen)
        for part, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            getattr(mod, f"{prefix}_{part}").copy_(t)
    return mod.cuda(), e, hidden, inter, g


def moe_reference(mod: AwqExperts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j w_j · down_e(silu(gate_e(x)) · up_e(x)) in float32, expert by expert over the
    pairs routed to it (ids outside [0, E) dropped), weights dequantized here."""
    g, e_count = mod.group_size, mod.gate_up_qweight.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(e_count):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w_gu = kernel_weight(
            mod.gate_up_qweight[e], mod.gate_up_qzeros[e], mod.gate_up_scales[e], g, torch.float32
        )
        w_dn = kernel_weight(mod.down_qweight[e], mod.down_qzeros[e], mod.down_scales[e], g, torch.float32)
        gate, up = (xf[tok] @ w_gu).chunk(2, dim=1)
        out.index_add_(0, tok, w[tok, slot, None].float() * ((torch.nn.functional.silu(gate) * up) @ w_dn))
    return out


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_awq_experts_random_configs(act):
    """AwqExperts on 24 random layers a dtype (1 to 64 experts, top-1 to top-8, 1 to 3000
    tokens: the grouped GEMV, the grouped tensor-core forms, the per-expert loop), with skewed
    routing (one expert takes a third of the pairs where there are several) and, on some
    draws, masked ids; each within the grouped tests' bound of a float32 reference."""
    rng = random.Random(4920 + (act == torch.bfloat16))
    for i in range(24):
        mod, e, hidden, inter, g = random_moe(rng, act, seed=200 + i)
        top_k = rng.randint(1, min(8, e))
        tokens = rng.choice((1, 2, 5, 16, 17, 64, 200, 700, 3000))
        gen = torch.Generator().manual_seed(300 + i)
        idx = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
        if e > top_k:  # skew: expert 0 in about a third of the tokens
            hot = torch.rand(tokens, generator=gen) < 0.33
            has = (idx == 0).any(1)
            idx[hot & ~has, 0] = 0
        if i % 3 == 2 and tokens > 1:
            idx[0, -1] = -1
            idx[tokens - 1, 0] = e
        wts = torch.rand(tokens, top_k, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen).to(act)
        x, idx, wts = x.cuda(), idx.cuda(), wts.cuda()
        y = mod(x, idx, wts)
        ref = moe_reference(mod, x, idx, wts)
        what = f"draw {i}: E={e} hidden={hidden} inter={inter} G={g} top-{top_k} tokens={tokens} {act}"
        assert y.shape == x.shape and y.dtype == act, what
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err < MOE_TOL[act], (what, err)


# --------------------------------------------------------------------------- quantization kernels

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def random_weight(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with some hard ones (a zero row, a constant row, tiny and huge rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    for r, f in ((0, 0.0), (rows // 2, 1e-6), (rows - 1, 300.0)):
        w[r] *= f
    if rows > 3:
        w[1] = 0.37
    if dtype == torch.float8_e4m3fn:
        w = w.clamp(-440, 440)
    return w.to(dtype)


def test_grid_and_pack_random_shapes():
    """build_quant_grid (range and MSE, 2 to 8 bits, asymmetric and symmetric, every weight
    dtype, FP8 with and without DeepSeek block scales, columns padded to whole groups or not)
    and the fused 4-bit quantize + pack on 48 random shapes: the GPU's bytes equal the CPU's."""
    rng = random.Random(4930)
    for i in range(48):
        dtype = rng.choice(WEIGHT_DTYPES)
        g = rng.choice((32, 64, 96, 128, 128, 160, 256))
        rows = rng.choice((rng.randint(1, 300), 8 * rng.randint(1, 400)))
        cols = g * rng.randint(1, 4096 // g)
        if i % 4 == 3:
            cols += rng.randint(1, g - 1)  # a padded last group (the grid only)
        bits, sym, mode = rng.choice((2, 3, 4, 4, 4, 8)), rng.random() < 0.3, rng.choice(("range", "mse"))
        w = random_weight(rows, cols, dtype, seed=400 + i)
        s = None
        if dtype == torch.float8_e4m3fn and rng.random() < 0.6:
            s = 10 ** (
                torch.rand(-(-rows // 128), -(-cols // 128), generator=torch.Generator().manual_seed(i)) * 4
                - 3
            )
        what = (
            f"draw {i}: {rows}x{cols} {dtype} G={g} bits={bits} sym={sym} {mode} block scales={s is not None}"
        )
        cpu = forge.build_quant_grid(w, g, bits, sym, mode, scale_inv=s)
        gpu = forge.build_quant_grid(w.cuda(), g, bits, sym, mode, scale_inv=None if s is None else s.cuda())
        assert gpu[1:] == cpu[1:], what
        assert torch.equal(gpu[0].cpu(), cpu[0]), what
        if bits == 4 and rows % 8 == 0 and cols % g == 0:  # AWQ: N % 8, whole groups
            want = forge.quantize_pack_awq(w, cpu[0], g, scale_inv=s)
            got = forge.quantize_pack_awq(
                w.cuda(), cpu[0].cuda(), g, scale_inv=None if s is None else s.cuda()
            )
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b.cpu()), what


def scaled_err(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> float:
    """max |got − want| / Σ_t |x_ti x_tj| (element by element; exact where the sum is 0)."""
    return float(((got.double() - want).abs() / mag.clamp_min(1e-30)).max())


def product_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cuBLAS's ``a @ b`` accumulated in float32 (tensor cores for 16-bit inputs): the peer."""
    return torch.mm(a, b) if a.dtype == torch.float32 else torch.mm(a, b, out_dtype=torch.float32)


def test_hessians_random_shapes():
    """hessian_update and hessian_update_segmented (adding, and overwrite) on 24 random
    shapes (D from 3 to 3000, D % 8 != 0 included; float32, float16, bfloat16 inputs; up to
    12000 rows; 1 to 40 experts, some without rows, a token routed to several) against the
    float64 product. Each result's largest error, element by element relative to
    ``Σ_t |x_ti x_tj|``, must be within the kernels' stated bound ``1e-6·√n`` (n: the rows
    summed) or at most twice that of cuBLAS's float32-accumulated product (the peer, with the
    same addition into the earlier contents), plus 1e-7; an expert without rows keeps exactly
    its earlier contents (adding) or is zeros (overwrite). Both forms: the fp32 SIMT kernel
    (float32 inputs, D % 8 != 0) sums each element's rows in sequence, so its error runs
    past the peer's (D = 79, 3298 bf16 rows: 5.1e-6 against 4.5e-7) within the √n bound; the
    tensor cores round their accumulation their own way, so a long segment's error grows
    with its rows (8756 rows: 1.8e-5)."""
    rng = random.Random(4940)
    for i in range(24):
        dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
        d = rng.choice((rng.randint(3, 300), 8 * rng.randint(1, 375)))
        t = rng.randint(1, 6000)
        gen = torch.Generator().manual_seed(500 + i)
        x = (torch.randn(t, d, generator=gen) * 2.0).to(dtype).cuda()
        xd = x.double()  # the references in float64 on the GPU
        what = f"draw {i}: T={t} D={d} {dtype}"
        start = torch.randn(d, d, generator=gen).abs().cuda()
        h = start.clone()
        forge.hessian_update(h, x, 0.5)
        want = start.double() + 0.5 * xd.T @ xd
        mag = 0.5 * (xd.abs().T @ xd.abs())
        peer = start + 0.5 * product_f32(x.T, x)
        got, limit = scaled_err(h, want, mag), max(1e-6 * t**0.5, 2 * scaled_err(peer, want, mag)) + 1e-7
        assert got <= limit, (what, got, limit)
        e = rng.randint(1, 40)
        pairs = rng.randint(0, 2 * t)
        idx = torch.randint(0, t, (pairs,), generator=gen, dtype=torch.int32).cuda()
        cuts = sorted(rng.randint(0, pairs) for _ in range(e - 1))
        bounds = [0, *cuts, pairs]
        offsets = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        overwrite = rng.random() < 0.5
        hs = torch.full((e, d, d), 3.0, device="cuda")
        forge.hessian_update_segmented(hs, x, idx, offsets, 1.0, overwrite=overwrite)
        base = 0.0 if overwrite else 3.0
        for j in range(e):
            rows = idx[bounds[j] : bounds[j + 1]].long()
            xe = xd[rows]
            want = xe.T @ xe + base
            mag = xe.abs().T @ xe.abs()
            peer = product_f32(x[rows].T, x[rows]) + base
            limit = max(1e-6 * rows.numel() ** 0.5, 2 * scaled_err(peer, want, mag)) + 1e-7
            got = scaled_err(hs[j], want, mag)
            assert got <= limit, (
                what,
                f"expert {j} of {e}, {rows.numel()} rows, overwrite={overwrite}",
                got,
                limit,
            )


def test_gptq_random_shapes():
    """gptq_solve_batched on the GPU against the CPU on 12 random problems (1 to 4 matrices,
    K = C up to 1152 in whole groups, N from 8 to 600, G 32 to 256, 2 to 8 bits, activation
    order or not): the codes agree on at least 99 % of entries and each matrix's layer error
    ``tr(ΔWᵀ H ΔW)`` is within 2 % of the CPU's (GPTQ propagates each rounding, so one flipped
    code moves later ones; the error it minimises is what must match)."""
    rng = random.Random(4950)
    for i in range(12):
        e = rng.randint(1, 4)
        g = rng.choice((32, 64, 128, 128, 256))
        k = g * rng.randint(1, 1152 // g)
        n = 8 * rng.randint(1, 75)
        bits, act_order = rng.choice((2, 3, 4, 4, 8)), rng.random() < 0.5
        gen = torch.Generator().manual_seed(600 + i)
        hs, ws = [], []
        for _ in range(e):
            x = torch.randn(2 * k, 16, generator=gen) @ torch.randn(16, k, generator=gen)
            x += 0.3 * torch.randn(2 * k, k, generator=gen)
            hs.append(2 * x.T @ x / x.shape[0])
            ws.append(torch.randn(n, k, generator=gen) * 0.1)
        h, w = torch.stack(hs), torch.stack(ws)
        qm = torch.stack([forge.build_quant_grid(wi, g, bits, False, "range")[0] for wi in ws])
        u, perm, _, _, _ = forge.prepare_hessian_batched(h, 0.01, act_order)
        wt = w.transpose(1, 2).contiguous()
        codes_cpu, deq_cpu = forge.gptq_solve_batched(wt, u, qm, bits, g, 128, perm)
        codes_gpu, deq_gpu = forge.gptq_solve_batched(
            wt.cuda(), u.cuda(), qm.cuda(), bits, g, 128, None if perm is None else perm.cuda()
        )
        what = f"draw {i}: E={e} K={k} N={n} G={g} bits={bits} act_order={act_order}"
        agree = float((codes_gpu.cpu() == codes_cpu).float().mean())
        assert agree >= 0.99, (what, agree)
        for j in range(e):
            errs = []
            for deq in (deq_cpu[j], deq_gpu[j].cpu()):
                dw = (w[j].T - deq).double()
                errs.append(float(torch.trace(dw.T @ h[j].double() @ dw)))
            assert abs(errs[1] - errs[0]) <= 0.02 * errs[0], (what, j, errs)


def test_prepare_hessian_random_shapes():
    """prepare_hessian_batched on the GPU on 16 random batches (C from 1 to 2600, odd and
    prime orders included, whose triangular inverse is one leaf or uneven levels; 1 to 9
    matrices; dead inputs; activation order or not; rank-deficient matrices, which only the
    damping makes definite) against float64: ``U`` upper with ``UᵀU = (Pᵀ(H' + damp I)P)⁻¹`` (``H'``: dead
    inputs' diagonal set to 1, ``P`` the inputs by descending diag(H), ties in input order),
    ``damp = 1 % of mean diag(H') · 10^retries``, within 1e-3 in Frobenius norm;
    damping, retries, dead counts and the order equal the CPU's."""
    rng = random.Random(4960)
    for i in range(16):
        c = rng.choice(
            (1, 2, 3, rng.randint(4, 400), rng.choice((127, 257, 509, 1021)), 8 * rng.randint(1, 325))
        )
        e = rng.randint(1, 9)
        act_order = rng.random() < 0.5
        gen = torch.Generator().manual_seed(700 + i)
        hs = []
        for j in range(e):
            t = c // 2 if (j == 0 and c > 8 and i % 3 == 0) else 2 * c + 8  # rank-deficient
            x = torch.randn(t, c, generator=gen, dtype=torch.float64) * (
                1 + 3 * torch.rand(c, generator=gen, dtype=torch.float64)
            )
            dead = torch.rand(c, generator=gen) < 0.02
            x[:, dead] = 0
            hs.append((x.T @ x / t).float())
        h = torch.stack(hs)
        what = f"draw {i}: E={e} C={c} act_order={act_order}"
        u_cpu, perm_cpu, damp_cpu, retries_cpu, dead_cpu = forge.prepare_hessian_batched(h, 0.01, act_order)
        u, perm, damp, retries, dead = forge.prepare_hessian_batched(h.cuda(), 0.01, act_order)
        assert retries == retries_cpu and dead == dead_cpu, what
        assert damp == pytest.approx(damp_cpu, rel=1e-5), what
        if act_order:
            assert torch.equal(perm.cpu(), perm_cpu), what
        for j in range(e):
            hd = h[j].double()
            diag = hd.diagonal().clone()
            diag[diag == 0] = 1.0
            hd.diagonal().copy_(diag)
            damp_ref = 0.01 * float(diag.mean()) * 10 ** retries[j]
            assert damp[j] == pytest.approx(damp_ref, rel=1e-5), (what, j)
            hd += damp[j] * torch.eye(c, dtype=torch.float64)
            if act_order:  # inputs by descending diag(H), ties in input order
                p = torch.sort(h[j].diagonal(), descending=True, stable=True).indices
                hd = hd[p][:, p]
            u_ref = torch.linalg.cholesky(torch.linalg.inv(hd), upper=True)
            err = float(torch.linalg.norm(u[j].cpu().double() - u_ref) / torch.linalg.norm(u_ref))
            assert err < 1e-3, (what, j, err)


def test_dequantize_awq_dense_random_shapes():
    """forge.dequantize_awq_dense on 30 random AWQ tensors (N % 8, G from 32 to 256, every
    output dtype): float32 exactly ``(q − z)·s``, float16 / bfloat16 exactly the weights the
    kernels multiply (the test's ``kernel_weight``)."""
    rng = random.Random(4970)
    for i in range(30):
        g = rng.choice((32, 64, 96, 128, 256))
        k, n = g * rng.randint(1, 4096 // g), 8 * rng.randint(1, 1024)
        dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
        qw, qz, sc = random_awq(k, n, g, gen=torch.Generator().manual_seed(800 + i))
        got = forge.dequantize_awq_dense(qw.cuda(), qz.cuda(), sc.cuda(), g, dtype)
        assert torch.equal(got.cpu(), kernel_weight(qw, qz, sc, g, dtype)), (
            f"draw {i}: K={k} N={n} G={g} {dtype}"
        )
