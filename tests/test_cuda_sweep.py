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
    return 2.0 if n % 32 or m >= runtime.DENSE_MIN_ROWS else 1.0


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
            n -= n % 8
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
