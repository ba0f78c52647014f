"""forge.runtime on CUDA (marker ``cuda``; skipped without a usable GPU): AwqLinear against
dequantize-then-matmul, CUDA-graph capture, torch.compile(mode="reduce-overhead") and
stream ordering.

Tolerances:
* against the float32 reference (weights dequantized in the test from the AWQ words, fp32
  GEMM on the same 16-bit activations): max |y - ref| / max |ref| below 4e-3 for float16
  and 2e-2 for bfloat16 (the kernel rounds dequantized weights to the activation type and
  the output to 16 bits; bf16 has 8 mantissa bits);
* CUDA-graph replay against eager: bit-exact (same shape, same plan, same kernels, no
  atomics);
* torch.compile(mode="reduce-overhead") against eager: within one unit in the last place of
  the 16-bit type relative to max |y| (2**-7 bf16, 2**-10 fp16); the GEMM is the same kernel,
  only the fused bias add may round differently.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import ref_weight  # the CPU tests' plain-torch unpacker (device-agnostic)

import forge
from forge.runtime import AwqLinear

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
    # the custom op (what torch.compile calls) is the same computation
    y_op = torch.ops.forge.awq_gemm(x, mod.qweight, mod.qzeros, mod.scales, group)
    assert torch.equal(y_op + mod.bias.to(dtype), y)


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
        eager = mod(x)
        assert y.shape == eager.shape and y.dtype == dtype
        assert float((y.float() - eager.float()).abs().max()) <= ULP[dtype] * float(eager.float().abs().max())
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == before


def test_launches_follow_the_current_stream():
    """The kernel runs on torch's current stream: work queued before it on a side stream
    (a long sleep, then the copy that fills x) finishes before it reads x, and its output is
    complete once that stream is waited on."""
    mod = random_layer(2048, 2048, 128)
    src = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    want = mod(src)
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
    assert torch.equal(y2, want)


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
