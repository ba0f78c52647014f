"""forge.runtime on CUDA (marker ``cuda``; skipped without a usable GPU): AwqLinear against
dequantize-then-matmul, CUDA-graph capture, torch.compile(mode="reduce-overhead") and
stream ordering; AwqExperts' grouped GEMV path (decode: few (token, expert) pairs) likewise,
and its tensor-core form (prefill: segments of 16 to 256 rows of one expert; the wgmma GEMM on
sm_90 for the shapes it takes, the mma.sync GEMM up to 64 rows on other shapes and GPUs).

Tolerances:
* against the float32 reference (weights dequantized in the test from the AWQ words, fp32
  GEMM on the same 16-bit activations): max |y - ref| / max |ref| below 4e-3 for float16
  and 2e-2 for bfloat16 (the kernel rounds dequantized weights to the activation type and
  the output to 16 bits; bf16 has 8 mantissa bits);
* CUDA-graph replay against eager: bit-exact (same shape, same plan, same kernels, no
  atomics);
* torch.compile(mode="reduce-overhead") against the custom op run eagerly: within one unit in
  the last place of the 16-bit type relative to max |y| (2**-7 bf16, 2**-10 fp16); the GEMM
  is the same kernel, only the fused bias add may round differently.
  Without a bias, after prepare_decode: bit-exact against the eager layer (decode-sized
  calls: the tiled GEMV on the same copy) and against the op (larger calls: the GEMM).

Eager calls of at most 16 rows (TILED_MAX_M) run the tiled GEMV on the layer's cached tile-layout copy
(forge.runtime.TILED_DECODE; checked against float64 in test_cuda.py), which does not round
the dequantized weights: they are held to the same reference bounds, and compared bit for
bit only with themselves (graph replay against eager), not with the GEMM.

Calls of at least forge.runtime.DENSE_MIN_ROWS rows dequantize the weights (as the kernels
take them) into a dense copy and multiply it with cuBLAS: bit for bit torch.mm on weights
written in the test, and within the same float32-reference bounds.

AwqExperts (grouped path), against a float32 reference written here (weights dequantized
from the AWQ words, x rounded to the 16-bit type, act(gate) * up and down in float32, the
top-k weighted sum in float32): max |y - ref| / max |ref| below twice the AwqLinear bounds
(8e-3 float16, 4e-2 bfloat16): the kernel also rounds the gate_up output, act(gate) * up
and the down output to the 16-bit type. CUDA-graph replay against eager: bit-exact (the
segment table is built on the GPU with deterministic ops, the kernel writes every output
once in a fixed order). torch.compile(mode="reduce-overhead") against eager: within the
same bounds as the reference (inductor fuses act(gate) * up in float32).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import kernel_weight, ref_weight  # the CPU tests' plain-torch references (device-agnostic)

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

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def random_layer(k: int, n: int, group: int, bias: bool = False, seed: int = 0) -> AwqLinear:
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31, (k, n // 8), generator=gen, dtype=torch.int64)
    qzeros = torch.randint(-(2**31), 2**31, (k // group, n // 8), generator=gen, dtype=torch.int64)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    b = torch.randn(n, generator=gen) if bias else None
    return AwqLinear.from_tensors(qweight.to(torch.int32), qzeros.to(torch.int32), scales, group, b).cuda()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


# (lead shape of x, K, N, G): GEMV (M <= 16, split K), SIMT GEMV (M = 1, N >= 8192),
# tiled GEMM (M > 16), a 3-D activation
SHAPES = [
    ((1,), 2048, 2048, 128),
    ((1,), 4096, 8192, 128),
    ((4,), 1024, 512, 64),
    ((16,), 2048, 768, 128),
    ((64,), 2048, 512, 128),
    ((2, 37), 1024, 256, 32),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead,k,n,group", SHAPES)
def test_awq_linear_matches_dequant_matmul(lead, k, n, group, dtype):
    mod = random_layer(k, n, group, bias=True)
    x = torch.randn(*lead, k, device="cuda").to(dtype)
    w = ref_weight(mod.qweight, mod.qzeros, mod.scales, group)
    ref = x.float() @ w.T + mod.bias.float()
    y = mod(x.clone())
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]
    # the custom op (what torch.compile calls) is the same computation, except that eager
    # decode-sized calls run the tiled GEMV (forge.runtime.TILED_DECODE) and the op the GEMM
    y_op = torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, group) + mod.bias.to(dtype)
    if "tiled" in mod._cache:
        assert x.numel() <= runtime.TILED_MAX_M * k and rel_err(y_op, ref) < TOL[dtype]
    else:
        assert torch.equal(y_op, y)


def test_awq_linear_float32_activations_run_through_fp16():
    mod = random_layer(512, 256, 128)
    x = torch.randn(3, 512, device="cuda")
    ref = x @ ref_weight(mod.qweight, mod.qzeros, mod.scales, 128).T
    y = mod(x)
    assert y.dtype == torch.float32
    assert rel_err(y, ref) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead,k,n,group", SHAPES)
def test_cuda_graph_replay_equals_eager(lead, k, n, group, dtype):
    mod = random_layer(k, n, group)
    static_x = torch.randn(*lead, k, device="cuda").to(dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod(static_x)  # warm-up: plans and loads the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode "global": any host sync would raise
        static_y = mod(static_x)
    for seed in range(3):
        new_x = torch.randn(*lead, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(new_x.to(dtype))
        graph.replay()
        eager = mod(static_x.clone())
        torch.cuda.synchronize()
        assert torch.equal(static_y, eager)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(1, 40), (3, 280), (17, 3608), (300, 72), (64, 48), (5, 48)])
def test_out_features_the_kernels_do_not_take(m, n, dtype):
    """AWQ allows any N % 8 == 0; the fused kernels take N % 32 == 0. Other layers (and
    forge.awq_matmul on such tensors) take the dense route at every M, DENSE_ROUTE or not:
    bit for bit ``torch.mm`` on the kernels' own weights written in the test, within the
    float32-reference bound; the same twice (the second call with no cached state to go
    stale) and under CUDA-graph replay. At M <= 16 with N % 16 == 0 the tiled GEMV takes them
    first (its own bound)."""
    k, group = 512, 64
    mod = random_layer(k, n, group, seed=n)
    w = kernel_weight(mod.qweight, mod.qzeros, mod.scales, group, dtype)
    ref = ref_weight(mod.qweight, mod.qzeros, mod.scales, group)
    x = torch.randn(m, k, device="cuda").to(dtype)
    y = forge.awq_matmul(x, mod.qweight, mod.qzeros, mod.scales, group)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.equal(y, torch.mm(x, w))
    assert rel_err(y, x.float() @ ref.T) < TOL[dtype]
    y_mod = mod(x)
    assert rel_err(y_mod, x.float() @ ref.T) < TOL[dtype]
    if m > runtime.TILED_MAX_M or n % 16:
        assert torch.equal(y_mod, y)
    assert torch.equal(mod(x), y_mod)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    mod(static_x)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_y = mod(static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, y_mod)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_route_for_many_rows(monkeypatch, dtype):
    """From DENSE_MIN_ROWS rows a CUDA call multiplies the kernels' own weights, dequantized
    into a dense copy, with cuBLAS: bit for bit ``torch.mm(x, W)`` with W written in the test,
    and within the float32-reference bound. A row fewer, the route switched off, or a layer
    over DENSE_MAX_BYTES run the fused kernel (bit for bit the custom op with the route off).
    CUDA-graph replay of the route equals eager."""
    monkeypatch.setattr(runtime, "DENSE_MIN_ROWS", 60)
    k, n, group = 1024, 512, 128
    mod = random_layer(k, n, group)
    w = kernel_weight(mod.qweight, mod.qzeros, mod.scales, group, dtype)
    ref_w = ref_weight(mod.qweight, mod.qzeros, mod.scales, group)
    x = torch.randn(2, 30, k, device="cuda").to(dtype)
    y = mod(x)
    assert y.shape == (2, 30, n) and y.dtype == dtype
    assert torch.equal(y, torch.mm(x.view(60, k), w).view(2, 30, n))
    assert rel_err(y, x.float() @ ref_w.T) < TOL[dtype]

    def fused(x):
        with monkeypatch.context() as m:
            m.setattr(runtime, "DENSE_ROUTE", False)
            return torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, group)

    y_fused = fused(x)
    assert not torch.equal(y, y_fused) and rel_err(y_fused, x.float() @ ref_w.T) < TOL[dtype]
    x59 = x.view(60, k)[:59]
    assert torch.equal(mod(x59), fused(x59))
    monkeypatch.setattr(runtime, "DENSE_MAX_BYTES", k * n * 2 - 1)
    assert torch.equal(mod(x), y_fused)
    monkeypatch.setattr(runtime, "DENSE_MAX_BYTES", k * n * 2)

    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mod(static_x)
    static_x.copy_(torch.randn(2, 30, k, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, mod(static_x.clone()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduce_overhead_compile_matches_eager(dtype):
    torch._dynamo.reset()
    mod = random_layer(2048, 1024, 128, bias=True)
    mod.bias.data = mod.bias.data.to(dtype)
    before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
    for m in (1, 1, 1, 8, 8, 8):
        x = torch.randn(m, 2048, device="cuda").to(dtype)
        torch.compiler.cudagraph_mark_step_begin()
        y = compiled(x).clone()
        # the compiled module runs the custom op (the GEMM); eager decode calls would take
        # the tiled GEMV, so compare with the op run eagerly
        eager = torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, 128) + mod.bias
        assert y.shape == eager.shape and y.dtype == dtype
        assert float((y.float() - eager.float()).abs().max()) <= ULP[dtype] * float(eager.float().abs().max())
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduce_overhead_compile_runs_the_tiled_gemv_after_prepare_decode(dtype):
    """With the tile copy made before compiling (prepare_decode, as load_quantized does on
    CUDA), the compiled layer's decode-sized calls run the tiled GEMV: bit for bit the eager
    layer's output (the same kernel), which differs from the GEMM's somewhere; larger calls
    keep the GEMM, bit for bit. The copy is a static input: no CUDA-graph skip."""
    torch._dynamo.reset()
    mod = random_layer(2048, 1024, 128, seed=3)
    assert runtime.prepare_decode(mod) == 2048 * 1024 // 2
    assert runtime.prepare_decode(mod) == 0  # already current
    before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
    differs = False
    for m in (1, 1, 1, 8, 8, 8, 16, 32, 32, 32):
        x = torch.randn(m, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
        torch.compiler.cudagraph_mark_step_begin()
        y = compiled(x).clone()
        assert rel_err(y, x.float() @ ref_weight(mod.qweight, mod.qzeros, mod.scales, 128).T) < TOL[dtype]
        gemm = torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, 128)
        if m <= runtime.TILED_MAX_M:
            eager = mod(x)  # the tiled GEMV on the same copy
            assert torch.equal(y, eager), m
            differs |= not torch.equal(eager, gemm)
        else:
            assert torch.equal(y, gemm), m
    assert differs, (
        "the tiled GEMV and the GEMM agreed bit for bit everywhere: the test cannot tell them apart"
    )
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == before


def test_launches_follow_the_current_stream():
    """The kernel runs on torch's current stream: work queued before it on a side stream
    (a long sleep, then the copy that fills x) finishes before it reads x, and its output is
    complete once that stream is waited on."""
    mod = random_layer(2048, 2048, 128)
    src = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    want = mod(src)  # the tiled GEMV (a decode-sized call)
    want_op = torch.ops.forge.awq_gemm(src, mod.qweight, mod.qzeros, mod.scales, 128)  # the GEMM
    x = torch.zeros_like(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream
        x.copy_(src)
        y = mod(x)
        y2 = torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, 128)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, want)
    assert torch.equal(y2, want_op)


def test_errors_are_python_exceptions():
    mod = random_layer(256, 64, 32)
    with pytest.raises(forge.errors.ShapeError):
        mod(torch.randn(2, 128, device="cuda", dtype=torch.float16))
    with pytest.raises(forge.errors.DeviceError):
        torch.ops.forge.awq_gemm(
            torch.randn(2, 256, device="cuda", dtype=torch.float16),
            mod.qweight.cpu(),
            mod.qzeros,
            mod.scales,
            32,
        )
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    tiles = forge.tile_awq(mod.qweight)
    with pytest.raises(forge.errors.ShapeError, match="tiles: expected int32"):
        torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, 32, tiles[:2])
    with pytest.raises(forge.errors.ShapeError, match="tiles: expected int32"):
        torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, 32, tiles.cpu())


# --------------------------------------------------------------------------- AwqExperts (grouped)

EXPERTS, HIDDEN, INTER, GROUP = 16, 256, 192, 64  # 2 * INTER and HIDDEN multiples of 32, GROUP a power of two
# Experts only the mma.sync GEMM takes on tensor cores (2 * INTER and INTER not multiples of 128
# and 64, G = 32): on every GPU from sm_80, the H100 / H200 included.
MMA_ONLY = (160, 32)


def random_experts(dtype: torch.dtype, seed: int = 0, inter: int = INTER, group: int = GROUP) -> AwqExperts:
    gen = torch.Generator().manual_seed(seed)
    mod = AwqExperts(EXPERTS, HIDDEN, inter, group, "silu", dtype=dtype)
    for prefix, (k, n) in (("gate_up", (HIDDEN, 2 * inter)), ("down", (inter, HIDDEN))):
        qweight = torch.randint(-(2**31), 2**31, (EXPERTS, k, n // 8), generator=gen, dtype=torch.int64)
        qzeros = torch.randint(
            -(2**31), 2**31, (EXPERTS, k // group, n // 8), generator=gen, dtype=torch.int64
        )
        scales = (torch.rand(EXPERTS, k // group, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
        for part, t in (
            ("qweight", qweight.to(torch.int32)),
            ("qzeros", qzeros.to(torch.int32)),
            ("scales", scales),
        ):
            getattr(mod, f"{prefix}_{part}").copy_(t)
    return mod.cuda()


def routing(tokens: int, top_k: int, seed: int = 0, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token with expert 3 in every other token (runs longer than a
    segment), and masked ids (-1 and EXPERTS) on two pairs."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    for t in range(0, tokens, 2):
        if not (idx[t] == 3).any():
            idx[t, 0] = 3
    if masked and tokens > 1:
        idx[1, -1] = -1
        idx[tokens - 1, 0] = EXPERTS
    return idx.cuda(), torch.rand(tokens, top_k, generator=gen).cuda()


def ref_moe(mod: AwqExperts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) in float32, dequantize-then-matmul."""
    g = mod.group_size
    w_gu = ref_weight(
        mod.gate_up_qweight, mod.gate_up_qzeros, mod.gate_up_scales, g
    )  # (EXPERTS, 2 * INTER, HIDDEN)
    w_dn = ref_weight(mod.down_qweight, mod.down_qzeros, mod.down_scales, g)  # (EXPERTS, HIDDEN, INTER)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if not 0 <= e < EXPERTS:
                continue
            gate, up = (w_gu[e] @ x[t].float()).chunk(2)
            out[t] += float(w[t, j]) * (w_dn[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def uses_grouped(mod: AwqExperts, monkeypatch) -> list[int]:
    """Counts the grouped kernel's launches (through runtime._cuda_moe_gemv)."""
    import forge.runtime as rt

    calls = []
    real = rt._cuda_moe_gemv

    def counting(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(rt, "_cuda_moe_gemv", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# tokens, top_k, rows a segment: one token's experts are distinct (1 row), up to 2 pairs an
# expert on average 2 rows, past it 4 (16 experts)
@pytest.mark.parametrize(
    "tokens,top_k,rows", [(1, 6, 1), (1, 8, 1), (3, 6, 2), (3, 8, 2), (16, 6, 4), (16, 8, 4)]
)
def test_awq_experts_grouped_matches_reference(tokens, top_k, rows, dtype, monkeypatch):
    mod = random_experts(dtype)
    calls = uses_grouped(mod, monkeypatch)
    monkeypatch.setattr("forge.runtime.GROUPED_TC", False)  # the SIMT GEMV at every size here
    idx, w = routing(tokens, top_k, seed=tokens * 10 + top_k)
    x = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
    y = mod(x, idx, w)
    assert calls == [rows, rows]  # gate_up and down, one launch each
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref_moe(mod, x, idx, w)) < 2 * TOL[dtype]
    # same as the per-expert loop (other kernels: within the same bound)
    monkeypatch.setattr("forge.runtime.GROUPED_MAX_PAIRS", 0)
    assert rel_err(mod(x, idx, w), ref_moe(mod, x, idx, w)) < 2 * TOL[dtype]
    # the per-expert path (prefill) keeps no second, tile-layout copy of any expert
    assert mod._caches and not any("tiled" in c for c in mod._caches.values())


def counts_silu_mul(monkeypatch) -> list[int]:
    """Counts the silu_mul kernel's launches (rows of each)."""
    calls = []
    real = runtime._native.silu_mul_launch

    def counting(x, bf16, rows, inter, out, device, stream):
        calls.append(rows)
        return real(x, bf16, rows, inter, out, device, stream)

    monkeypatch.setattr(runtime._native, "silu_mul_launch", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 2048), (6, 2 * 1408), (300, 16), (2, 3, 2 * 24)])
def test_silu_mul_is_torch_silu_times_up(shape, dtype, monkeypatch):
    """One launch whose result is torch's ``silu(gate) * up``: within 2 ulps everywhere, equal
    on 99.9 % of the outputs or more (an fp32 silu on a rounding edge may round the other
    way), the edges (signed zeros, exp(-g) overflowing fp32, the type's large values) too."""
    calls = counts_silu_mul(monkeypatch)
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    big = 6e4 if dtype == torch.float16 else 1e30
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 120.0, -120.0, big, -big]).to(dtype)
    x = x.cuda()
    y = runtime.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert calls == [x.numel() // shape[-1]]
    assert y.shape == ref.shape and y.dtype == dtype
    assert ((y == ref) | (y.isnan() & ref.isnan())).float().mean() >= 0.999
    tiny = torch.finfo(dtype).smallest_normal * 2.0**-10 if dtype == torch.float16 else 0.0
    torch.testing.assert_close(y, ref, rtol=2 * ULP[dtype], atol=tiny, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_falls_back_to_torch(dtype, monkeypatch):
    """Shapes and layouts the kernel does not take run torch's two ops, with their result."""
    calls = counts_silu_mul(monkeypatch)
    x = torch.randn(5, 64, device="cuda").to(dtype)
    for case in (x[:, :24], x.t().contiguous().t(), torch.randn(5, 24, device="cuda").to(dtype)):
        gate, up = case.chunk(2, dim=-1)
        assert torch.equal(runtime.silu_mul(case), torch.nn.functional.silu(gate) * up)
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False])
def test_awq_experts_take_silu_mul(grouped, dtype, monkeypatch):
    """The experts' act(gate) * up is one silu_mul launch a forward (the grouped form) or an
    expert (the loop), with the reference's result; a non-silu activation takes torch's ops."""
    mod = random_experts(dtype)
    calls = counts_silu_mul(monkeypatch)
    if not grouped:
        monkeypatch.setattr("forge.runtime.GROUPED_TC", False)
        monkeypatch.setattr("forge.runtime.GROUPED_MAX_PAIRS", 0)
    idx, w = routing(16, 6, seed=16)
    x = torch.randn(16, HIDDEN, device="cuda").to(dtype)
    y = mod(x, idx, w)
    used = {int(e) for e in idx.flatten() if 0 <= e < EXPERTS}  # experts the loop runs
    assert len(calls) == (1 if grouped else len(used))
    assert rel_err(y, ref_moe(mod, x, idx, w)) < 2 * TOL[dtype]
    gelu = AwqExperts(EXPERTS, HIDDEN, INTER, GROUP, "gelu", dtype=dtype).cuda()
    gelu.load_state_dict(mod.state_dict())
    calls.clear()
    gelu(x, idx, w)
    assert calls == []


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_moe_gemv_every_row_variant(rows, dtype):
    """The op on its own, each kernel variant: rows of masked pairs are exact zeros, the
    others match dequantize-then-matmul (K = 2048 splits K into fp32 partials)."""
    from forge.runtime import moe_segments

    gen = torch.Generator().manual_seed(rows)
    e, k, n, g = 8, 2048, 512, 128
    qweight = torch.randint(-(2**31), 2**31, (e, k, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-(2**31), 2**31, (e, k // g, n // 8), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    scales = (torch.rand(e, k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    qweight, qzeros, scales = qweight.cuda(), qzeros.cuda(), scales.cuda()
    idx = torch.randint(0, e, (5, 4), generator=gen)
    idx[0, :] = 2  # one expert 4 times in a token: a run longer than 1 and 2 rows
    idx[2, 1], idx[4, 3] = -5, e
    idx = idx.cuda()
    order, seg = moe_segments(idx, e, rows)
    x = torch.randn(5, k, device="cuda").to(dtype)
    tokens = torch.div(order, 4, rounding_mode="floor")
    y = torch.ops.forge.awq_moe_gemv(x, tokens, order, seg, qweight, qzeros, scales, g, rows)
    assert y.shape == (20, n) and y.dtype == dtype
    w = ref_weight(qweight, qzeros, scales, g)  # (e, n, k)
    flat = idx.reshape(-1)
    for p in range(20):
        ex = int(flat[p])
        if not 0 <= ex < e:
            assert (y[p] == 0).all()
            continue
        ref = w[ex] @ x[p // 4].float()
        assert rel_err(y[p], ref) < TOL[dtype]


def random_stack(
    e: int, k: int, n: int, g: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked AWQ tensors of ``e`` experts on the GPU: random words, scales in [0.001, 0.021)."""
    gen = torch.Generator().manual_seed(seed)

    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)

    scales = (torch.rand(e, k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    return words(e, k, n // 8).cuda(), words(e, k // g, n // 8).cuda(), scales.cuda()


def needs_grouped_tc(rows: int, *shapes: tuple[int, int, int]) -> int:
    """Skips unless this GPU runs the grouped tensor-core form with ``rows`` rows a segment for
    every (K, N, G); returns the most rows it takes for all of them."""
    dev = torch.device("cuda")
    most = min(runtime.grouped_tc_max_rows(dev, k, n, g) for k, n, g in shapes)
    if most < rows:
        pytest.skip(f"this GPU runs the grouped tensor-core form with at most {most} rows for these shapes")
    return most


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,k,n,g",
    [(r, 576, 384, 192) for r in runtime.GROUPED_TC_ROWS]
    + [(r, 512, 352, 32) for r in runtime.GROUPED_TC_ROWS if r <= 64],
)
def test_awq_moe_gemv_tensor_core_rows(rows, k, n, g, dtype):
    """The op with the tensor-core form's rows (a segment a block): runs of one expert longer
    than a segment, masked pairs exact zeros, every other row dequantize-then-matmul. G = 192
    is not a power of two (the wgmma GEMM on sm_90, the mma.sync GEMM elsewhere); N = 352 and
    G = 32 only the mma.sync GEMM takes, on every GPU (up to 64 rows)."""
    from forge.runtime import moe_segments

    e, t, top_k = 8, 96, 4
    needs_grouped_tc(rows, (k, n, g))
    qweight, qzeros, scales = random_stack(e, k, n, g, seed=rows)
    gen = torch.Generator().manual_seed(rows + 1)
    idx = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    idx[::2, 0] = torch.where(idx[::2].eq(2).any(1), idx[::2, 0], 2)  # expert 2 in every other token
    idx[2, 1], idx[4, 3] = -5, e
    idx = idx.cuda()
    order, seg = moe_segments(idx, e, rows)
    x = torch.randn(t, k, device="cuda").to(dtype)
    tokens = torch.div(order, top_k, rounding_mode="floor")
    y = torch.ops.forge.awq_moe_gemv(x, tokens, order, seg, qweight, qzeros, scales, g, rows)
    assert y.shape == (t * top_k, n) and y.dtype == dtype
    flat = idx.reshape(-1).cpu()
    valid = (flat >= 0) & (flat < e)
    assert (y[~valid.cuda()] == 0).all()
    w = ref_weight(qweight, qzeros, scales, g)  # (e, n, k)
    ref = torch.einsum("pnk,pk->pn", w[flat.clamp(0, e - 1)], x.float()[torch.arange(t * top_k) // top_k])
    assert rel_err(y[valid.cuda()], ref[valid.cuda()]) < TOL[dtype]


def test_awq_moe_gemv_tensor_core_shapes_it_does_not_take():
    """Shapes past both tensor-core kernels are named errors, not launches: N not a multiple
    of 32 at any tile, and 128 rows a segment where the wgmma GEMM does not run."""
    from forge.runtime import moe_segments

    needs_grouped_tc(16, (512, 352, 32))
    x = torch.randn(16, 512, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 2, (16, 2)).cuda()
    order, seg = moe_segments(idx, 2, 16)
    tokens = torch.div(order, 2, rounding_mode="floor")
    bad = random_stack(2, 512, 40, 128, seed=0)  # N = 40: not a multiple of 32
    with pytest.raises(forge.errors.ForgeError, match="multiple of 32"):
        runtime._cuda_moe_gemv(x, tokens, order, seg, *bad, 128, 16)
    mma_only = random_stack(2, 512, 352, 32, seed=0)  # N = 352, G = 32: the mma.sync GEMM's, up to 64
    with pytest.raises(forge.errors.ForgeError, match="multiple of 128"):
        runtime._cuda_moe_gemv(x, tokens, order, seg, *mma_only, 32, 128)


# tokens, top_k, rows a segment: 480 / 900 / 2400 pairs over 16 experts, 30 / 57 / 150 an expert
# on average, take the tiles of 32, 64 and 128 rows (at most 64 on the mma.sync GEMM)
PREFILL = [(80, 6, 32), (150, 6, 64), (300, 8, 128)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,tile", PREFILL)
@pytest.mark.parametrize("inter,group", [(INTER, GROUP), MMA_ONLY])
def test_awq_experts_prefill_takes_the_tensor_core_form(
    tokens, top_k, tile, dtype, inter, group, monkeypatch
):
    """Past GROUPED_TC_MIN_SHARE pairs per expert both projections are one tensor-core launch
    each (on sm_90 the wgmma GEMM for the first experts, the mma.sync GEMM for MMA_ONLY; on
    other GPUs the mma.sync GEMM for both), with the reference's result and the per-expert
    loop's (GROUPED_TC off) within the same bound."""
    most = needs_grouped_tc(16, (HIDDEN, 2 * inter, group), (inter, HIDDEN, group))
    mod = random_experts(dtype, inter=inter, group=group)
    calls = uses_grouped(mod, monkeypatch)
    idx, w = routing(tokens, top_k, seed=tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
    y = mod(x, idx, w)
    rows = min(tile, most)
    assert calls == [rows, rows] and rows in runtime.GROUPED_TC_ROWS and rows <= most
    ref = ref_moe(mod, x, idx, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref) < 2 * TOL[dtype]
    monkeypatch.setattr("forge.runtime.GROUPED_TC", False)
    monkeypatch.setattr("forge.runtime.GROUPED_MAX_PAIRS", 0)
    loop = mod(x, idx, w)
    assert len(calls) == 2  # the loop launched no grouped kernel
    assert rel_err(loop, ref) < 2 * TOL[dtype]
    # a segment table taller than the launch's grid takes the loop
    monkeypatch.setattr("forge.runtime.GROUPED_TC", True)
    assert mod._grouped_rows(x, tokens * top_k) == rows
    monkeypatch.setattr(runtime._native, "GROUPED_MAX_SEGMENTS", 1)
    assert mod._grouped_rows(x, tokens * top_k) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_experts_prefill_takes_256_row_segments(dtype, monkeypatch):
    """Where a pair of ``GROUPED_TC_WIDE`` holds (one lowered here to this small layer: 600 x 8
    pairs, 300 an expert), both projections run 256-row segments on the wgmma GEMM, runs of an
    expert longer than one segment included, with the reference's result; the default pairs
    keep this layer at 128 rows."""
    needs_grouped_tc(256, (HIDDEN, 2 * INTER, GROUP), (INTER, HIDDEN, GROUP))
    mod = random_experts(dtype)
    calls = uses_grouped(mod, monkeypatch)
    idx, w = routing(600, 8, seed=600)
    x = torch.randn(600, HIDDEN, device="cuda").to(dtype)
    assert mod._grouped_rows(x, idx.numel()) == 128
    monkeypatch.setattr("forge.runtime.GROUPED_TC_WIDE", ((256, (HIDDEN + INTER) // 2),))
    y = mod(x, idx, w)
    assert calls == [256, 256]
    ref = ref_moe(mod, x, idx, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 6), (16, 8), (150, 6)])
def test_awq_experts_cuda_graph_replay_equals_eager(tokens, top_k, dtype):
    """Decode (the SIMT GEMV, or past 2 pairs an expert the tensor-core form) and prefill
    (150 x 6 pairs: the tensor-core form) read nothing back: the forward captures into a CUDA
    graph, and each replay is bit for bit the eager forward."""
    if tokens * top_k > runtime.GROUPED_MAX_PAIRS:
        needs_grouped_tc(16, (HIDDEN, 2 * INTER, GROUP), (INTER, HIDDEN, GROUP))
    mod = random_experts(dtype)
    static_x = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
    static_idx, static_w = routing(tokens, top_k)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod(static_x, static_idx, static_w)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # any host sync (a .tolist() of counts) would raise here
        static_y = mod(static_x, static_idx, static_w)
    for seed in range(1, 4):  # new activations and a new routing each replay
        idx, w = routing(tokens, top_k, seed=seed, masked=seed != 2)
        static_x.copy_(torch.randn(tokens, HIDDEN, device="cuda").to(dtype))
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        eager = mod(static_x.clone(), static_idx.clone(), static_w.clone())
        torch.cuda.synchronize()
        assert torch.equal(static_y, eager)
        assert rel_err(eager, ref_moe(mod, static_x, static_idx, static_w)) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_experts_reduce_overhead_compile(dtype):
    torch._dynamo.reset()
    mod = random_experts(dtype)
    before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(mod, fullgraph=True, mode="reduce-overhead")  # a graph break would raise
    for tokens, top_k in ((1, 6), (1, 6), (1, 6), (16, 6), (16, 6), (16, 6)):
        idx, w = routing(tokens, top_k, seed=tokens)
        x = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
        torch.compiler.cudagraph_mark_step_begin()
        y = compiled(x, idx, w).clone()
        assert y.shape == x.shape and y.dtype == dtype
        assert rel_err(y, ref_moe(mod, x, idx, w)) < 2 * TOL[dtype]
        assert rel_err(y, mod(x, idx, w)) < 2 * TOL[dtype]
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == before


@pytest.mark.parametrize(
    "tokens,top_k,experts,rows",
    [
        (1, 8, 256, 1),
        (3, 6, 64, 2),
        (16, 8, 256, 4),
        (64, 6, 64, 4),
        (37, 2, 33, 3),
        (1, 1, 1, 1),
        (1024, 8, 1024, 4),
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_moe_route_kernel_matches_torch_ops(tokens, top_k, experts, rows, dtype):
    """The CUDA routing kernel builds the same order, tokens and segment table (bit for bit)
    as the torch ops run on the CPU, masked ids and stale table rows included."""
    from forge.runtime import moe_route, moe_segments

    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    idx = torch.randint(0, experts, (tokens, top_k), generator=gen)
    hot = torch.rand(tokens, top_k, generator=gen) < 0.4  # skewed: most pairs on 4 experts
    idx = torch.where(hot, idx % 4, idx)
    idx.view(-1)[:: max(1, idx.numel() // 5)] = -1  # masked ids, both sides of [0, E)
    idx.view(-1)[1 :: max(2, idx.numel() // 3)] = experts + 2
    order, tokens_of, seg = moe_route(idx.to(dtype).cuda(), experts, rows)
    want_order, want_seg = moe_segments(idx, experts, rows)
    assert order.is_cuda and order.dtype == tokens_of.dtype == seg.dtype == torch.int32
    assert torch.equal(order.cpu(), want_order)
    assert torch.equal(tokens_of.cpu(), torch.div(want_order, top_k, rounding_mode="floor"))
    assert torch.equal(seg.cpu(), want_seg)


def test_moe_route_past_the_kernel_limits_takes_the_torch_ops(monkeypatch):
    from forge import _native
    from forge.runtime import moe_route, moe_segments

    calls = []
    monkeypatch.setattr(_native, "moe_route_launch", lambda *a: calls.append(a))
    idx = torch.randint(0, 4, (_native.MOE_ROUTE_MAX_PAIRS // 8 + 1, 8), device="cuda")
    order, _, seg = moe_route(idx, 4, 4)
    assert not calls and torch.equal(order.cpu(), moe_segments(idx.cpu(), 4, 4)[0])
    moe_route(idx[:2], 4, 4)
    assert len(calls) == 1  # within the limits: the kernel


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (16, 6, 64), (300, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_moe_combine_kernel_matches_reference(tokens, top_k, hidden, dtype, wdtype):
    """The CUDA top-k weighted sum against float64 (within one rounding of the output type
    plus float32 sums) and the torch ops; a masked pair's NaN weight never reaches the output."""
    from forge.runtime import moe_combine

    e = 16
    gen = torch.Generator().manual_seed(tokens + top_k)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    idx = torch.randint(0, e, (tokens, top_k), generator=gen)
    idx.view(-1)[:: max(1, idx.numel() // 4)] = -1
    idx.view(-1)[1 :: max(2, idx.numel() // 3)] = e
    valid = (idx >= 0) & (idx < e)
    w = torch.where(valid, torch.rand(tokens, top_k, generator=gen), float("nan")).to(wdtype)
    ref = (y.double().view(tokens, top_k, hidden) * torch.where(valid, w.double(), 0.0)[..., None]).sum(1)
    out = moe_combine(y.cuda(), w.cuda(), idx.cuda(), e)
    assert out.dtype == dtype and out.shape == (tokens, hidden) and torch.isfinite(out).all()
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    bound = ulp * ref.abs() + 1e-6 * (y.double().abs().view(tokens, top_k, hidden).sum(1) + 1)
    assert ((out.double().cpu() - ref).abs() <= bound).all()
    torch_ops = moe_combine(y, w, idx, e)  # the CPU path: the torch ops
    assert ((out.double().cpu() - torch_ops.double()).abs() <= 2 * bound).all()
