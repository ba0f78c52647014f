"""CUDA kernels against the CPU core, through the public API (marker ``cuda``; skipped
without a usable GPU). Integer outputs (qmeta bytes, codes, packed words) must be
bit-exact; floating-point results within the stated tolerances."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_runtime import kernel_weight  # plain-torch AWQ unpacking, nothing from forge

import forge

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and forge.cuda_status()["available"]),
        reason="needs an NVIDIA GPU with a CUDA driver",
    ),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def adversarial(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows plus all-equal groups, zeros, huge and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0] = 0.0
    w[1] = 0.37
    if n > 4:
        w[2] *= 1e-6
        w[3] *= 300.0 if dtype in (torch.float8_e4m3fn, torch.float16) else 1e4
        w[4, : k // 2] = -1.0
    if dtype == torch.float8_e4m3fn:
        w = w.clamp(-440, 440)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group,sym", [(4, 128, False), (4, 64, True), (3, 32, False), (8, 256, True)])
@pytest.mark.parametrize("mode", ["range", "mse"])
@pytest.mark.parametrize("cols", [700, 704])  # a padded last group, read by element / 8 at a time
def test_grid_bit_exact(dtype, bits, group, sym, mode, cols):
    w = adversarial(48, cols, dtype)
    cpu = forge.build_quant_grid(w, group, bits, sym, mode)
    gpu = forge.build_quant_grid(w.cuda(), group, bits, sym, mode)
    assert gpu[1:] == cpu[1:]
    assert torch.equal(gpu[0].cpu(), cpu[0])


def test_grid_scales_at_every_encode_threshold():
    """Scales a few ulps either side of each of the 256 thresholds of the qmeta4 encode
    (``THRESH[k] = f32(2^((k + 0.5) / 256))``, where the stored log2 code steps from k to
    k + 1): the GPU's encode (a hardware-log2 guess settled by the table) gives the CPU's codes,
    and the scan does cross every threshold."""
    t = (2.0 ** ((torch.arange(256, dtype=torch.float64) + 0.5) / 256)).float()
    amax = (t.double() * 7.5).float().view(torch.int32)  # symmetric 4-bit: s = 2·amax / 15
    steps = torch.arange(-3, 4, dtype=torch.int32)
    a = (amax[:, None] + steps[None, :]).view(torch.float32).reshape(-1)
    w = torch.zeros(a.numel(), 32)
    w[:, 5] = a
    cpu = forge.build_quant_grid(w, 32, 4, True, "range")[0]
    gpu = forge.build_quant_grid(w.cuda(), 32, 4, True, "range")[0]
    assert torch.equal(gpu.cpu(), cpu)
    code = (cpu[:, 0, 0].long() | (cpu[:, 0, 1].long() << 8)).view(256, len(steps))
    k = torch.arange(256)[:, None]
    assert bool(((code == k).any(1) & (code == k + 1).any(1)).all())


def test_mse_grids_on_concurrent_streams_are_independent():
    """Two MSE searches with different candidate grids queued on two streams at once: each
    equals its CPU result (the candidates once lived in one __constant__ table both overwrote)."""
    w = adversarial(512, 1024, torch.float32, seed=3).cuda()
    grids = [(0.2, 100, 2.4), (0.5, 17, 2.0)]
    want = [forge.build_quant_grid(w.cpu(), 128, 4, False, "mse", *g)[0] for g in grids]
    streams = [torch.cuda.Stream() for _ in grids]
    torch.cuda.synchronize()
    for _ in range(3):
        got = []
        for st, g in zip(streams, grids, strict=True):
            with torch.cuda.stream(st):
                got.append(forge.build_quant_grid(w, 128, 4, False, "mse", *g)[0])
        torch.cuda.synchronize()
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k,n,group",
    # 480 / 96: groups that start inside the kernel's tiles (64 inputs; FP8's 256, three groups
    # a tile) and a part last tile; 160 / 32: two groups a tile (FP8: five) and a part last tile;
    # 512 / 64: FP8's four groups a tile; 264, 136 and 40 rows: a partial row tile (256 rows;
    # FP8's 64)
    [(256, 64, 128), (512, 136, 64), (7168 // 4, 256, 128), (480, 264, 96), (160, 40, 32)],
)
def test_quantize_pack_bit_exact(dtype, k, n, group):
    w = adversarial(n, k, dtype, seed=1)
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, False, "range")
    cpu = forge.quantize_pack_awq(w, qmeta, group)
    gpu = forge.quantize_pack_awq(w.cuda(), qmeta.cuda(), group)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("k,n,group", [(640, 296, 128), (480, 264, 96), (2048, 512, 32)])
@pytest.mark.parametrize("signs", ["positive", "mixed"])
def test_block_scaled_fp8_bit_exact(k, n, group, signs):
    """FP8 bytes and DeepSeek block scales read by the grid and pack kernels as stored: the
    same qmeta and packed tensors as the CPU (which dequantizes first). "mixed": negative
    block scales and a zero one too (the range grid takes a block's min and max of the raw
    values and scales those, which must pick the other end under a negative scale)."""
    g = torch.Generator().manual_seed(5)
    w8 = adversarial(n, k, torch.float8_e4m3fn, seed=4)
    s = 10 ** (torch.rand(-(-n // 128), -(-k // 128), generator=g) * 4 - 3)
    if signs == "mixed":
        s[::2, 1::2] *= -1
        s[1::2, ::2] *= -1
        s[-1, -1] = 0.0
    for mode in ("range", "mse"):
        cpu = forge.build_quant_grid(w8, group, 4, False, mode, scale_inv=s)[0]
        gpu = forge.build_quant_grid(w8.cuda(), group, 4, False, mode, scale_inv=s.cuda())[0]
        assert torch.equal(gpu.cpu(), cpu)
    cpu = forge.quantize_pack_awq(w8, qmeta := cpu, group, scale_inv=s)
    gpu = forge.quantize_pack_awq(w8.cuda(), qmeta.cuda(), group, scale_inv=s.cuda())
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())
    s[0, 0] = float("inf")
    with pytest.raises(forge.errors.InvalidValueError, match="scale_inv"):
        forge.quantize_pack_awq(w8.cuda(), qmeta.cuda(), group, scale_inv=s.cuda())


@pytest.mark.parametrize(
    "dtype,block_scale",
    [(dt, None) for dt in DTYPES] + [(torch.float8_e4m3fn, 0.5)],  # block scales: FP8's
)
def test_quantize_pack_rounding_edges(dtype, block_scale):
    """The fused pack's rounding where it can go wrong: arguments x·inv + z exactly half-way
    between two codes (ties to even), just either side of the halves, far outside the grid
    (clamped to 0 and 15, huge magnitudes included) and signed zeros, on a grid of scale 1/8 and
    zero point 8 (so 1/scale = 8 exactly). The codes must be clamp(round_half_even(fl(fl(x·inv) +
    z)), 0, 15), as a float32 PyTorch formula gives them, and equal the CPU's."""
    n, k, group = 64, 512, 128
    # x·8 + 8 = c + 1/2 (c = -4 .. 19), x = the weight times its block scale
    halves = [(2 * c - 15) / 16 / (block_scale or 1.0) for c in range(-4, 20)]
    big = {torch.float32: 1e30, torch.float16: 6e4, torch.bfloat16: 1e30, torch.float8_e4m3fn: 448.0}[dtype]
    edges = [0.0, -0.0, big, -big, 2.0, -2.0, 1e-3, -1e-3]
    if dtype == torch.float32:
        edges += [1e-40, -1e-40]  # subnormal
        halves += [h + d for h in halves for d in (2**-20, -(2**-20))]  # a hair either side
    vals = torch.tensor(halves + edges, dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    w32 = vals[torch.randint(len(vals), (n, k), generator=g)]
    w32[:, : len(vals)] = vals  # every value at least once a row
    w = w32.to(dtype)
    qmeta = forge.encode_qmeta(
        torch.full((n, k // group), 0.125), torch.full((n, k // group), 8, dtype=torch.uint8), False
    )
    s = None if block_scale is None else torch.full((-(-n // 128), k // 128), block_scale)
    x = w.float() * (block_scale or 1.0)  # the dequantized weight (exact: a power of two)
    want = torch.round(x * 8.0 + 8.0).clamp(0, 15).to(torch.uint8).T  # (K, N); x·8 exact, one rounding
    cpu = forge.quantize_pack_awq(w, qmeta, group, scale_inv=s)
    gpu = forge.quantize_pack_awq(w.cuda(), qmeta.cuda(), group, scale_inv=None if s is None else s.cuda())
    codes, _ = forge.unpack_awq(gpu[0].cpu(), gpu[1].cpu(), group)
    assert torch.equal(codes, want)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())


def test_pack_codes_bit_exact():
    g = torch.Generator().manual_seed(2)
    k, n, group = 512, 264, 64
    w = torch.randn(n, k, generator=g)
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, True, "range")
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=g)
    cpu = forge.pack_awq(codes, qmeta, group)
    gpu = forge.pack_awq(codes.cuda(), qmeta.cuda(), group)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a, b.cpu())


def awq_matmul_rel_err(act, m, k, n, group, seed, mode):
    """forge.awq_matmul on the GPU of random weights (quantized on the `mode` grid) and
    activations: (y, max |y − ref| / max |ref|) against a float64 reference."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, False, mode)
    qw, qz, sc = forge.quantize_pack_awq(w, qmeta, group)
    x = torch.randn(m, k, generator=g).to(act)
    ref = x.double() @ forge.dequantize_awq(qw, qz, sc, group).double().t()
    y = forge.awq_matmul(x.cuda(), qw.cuda(), qz.cuda(), sc.cuda(), group)
    return y, float((y.double().cpu() - ref).abs().max() / ref.abs().max())


def awq_matmul_tol(act):
    return 2e-3 if act == torch.float16 else 1.6e-2


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 5, 9, 16, 20, 33, 128, 300])
@pytest.mark.parametrize("k,n,group", [(1024, 256, 128), (2048, 512, 64), (768, 1024, 32), (7168, 384, 128)])
def test_awq_matmul_close_to_reference(act, m, k, n, group):
    y, err = awq_matmul_rel_err(act, m, k, n, group, 3, "mse")
    assert y.dtype == act and y.shape == (m, n)
    assert err < awq_matmul_tol(act), err


# (m, k, n, group): M = 1 at N below and above 8192 (where the default switches GEMV), M = 2..4.
SMALL_M_CASES = [(1, 4096, 2048, 128), (1, 2048, 7168, 64), (2, 1024, 544, 64), (3, 2048, 160, 32),
                 (4, 7168, 384, 128), (1, 1024, 8192, 128)]  # fmt: skip


def awq_matmul_in_child(cases: str, env: dict[str, str]) -> list:
    """forge.awq_matmul on every (m, k, n, group) of this module's list ``cases``, f16 then bf16,
    in a child process with ``env`` added (the kernel knobs are read once per process): per case
    and dtype (max |y − ref| / max |ref|, the plan's split-K workspace bytes, sha256 of y), each
    error asserted within the dtype's tolerance of the float64 reference."""
    script = (
        f"import hashlib, json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import torch\n"
        "from forge import _native\n"
        f"from test_cuda import {cases} as CASES, awq_matmul_rel_err\n"
        "out = []\n"
        "for c in CASES:\n"
        "    for a in (torch.float16, torch.bfloat16):\n"
        "        y, e = awq_matmul_rel_err(a, *c, c[0] * 7 + c[1], 'range')\n"
        "        ws = _native.w4a16_workspace_bytes(0, c[0], c[2], c[1], c[3])\n"
        "        out.append((e, ws, hashlib.sha256(y.cpu().view(torch.int16).numpy().tobytes()).hexdigest()))\n"
        "print(json.dumps(out))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    case_list = globals()[cases]
    assert len(rows) == 2 * len(case_list)
    for i, (e, _, _) in enumerate(rows):
        act = torch.float16 if i % 2 == 0 else torch.bfloat16
        assert e < awq_matmul_tol(act), (env, case_list[i // 2], act, e)
    return rows


def test_awq_matmul_small_m_forced_gemvs():
    """Both small-M GEMVs stay correct on shapes the default dispatch gives to the other one
    (the tensor-core v1 at M = 1 and N >= 8192 is otherwise never run, nor the SIMT v3 at
    M = 2..4 or N < 8192): each forced through `FORGE_GEMV`, read once per process, in a
    child process. The two children's outputs must differ somewhere (the kernels round
    differently), which shows the knob reached the dispatch."""
    runs = {v: awq_matmul_in_child("SMALL_M_CASES", {"FORGE_GEMV": v}) for v in ("1", "3")}
    assert [h for _, _, h in runs["1"]] != [h for _, _, h in runs["3"]], (
        "FORGE_GEMV did not change the kernel"
    )


# (m, k, n, group) the Hopper wgmma GEMM splits along K: the DeepSeek expert shapes at M = 12
# / 24 / 64 / 128 (its 16-, 32-, 64- and 128-token tiles), three M blocks with a partial last
# one, and a group size of 64.
WG_SPLIT_CASES = [(128, 2048, 7168, 128), (64, 7168, 2048, 128), (24, 7168, 2048, 128), (12, 7168, 2048, 128),
                  (300, 1024, 512, 64), (130, 4096, 1024, 128)]  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the wgmma GEMM runs on sm_90 only",
)
@pytest.mark.parametrize("splits", ["", "3", "8"])
def test_awq_matmul_cluster_sum_equals_workspace_sum(splits):
    """The wgmma GEMM sums its K splits either in a thread block cluster (the blocks of one
    output tile add each other's fp32 tiles from shared memory, in split order) or through
    the fp32 workspace and the reduction kernel: the outputs must be bit-identical, and
    within the reference tolerance. Each reduction forced through `FORGE_GEMM_WG_CLUSTER`
    (read once per process) in a child process, at the planned split count and at 3 and 8
    (`FORGE_GEMM_WG_SPLITS`); the workspace each plan asks for (none for clusters) shows the
    knob reached the dispatch."""
    runs = {
        c: awq_matmul_in_child("WG_SPLIT_CASES", {"FORGE_GEMM_WG_CLUSTER": c, "FORGE_GEMM_WG_SPLITS": splits})
        for c in ("0", "1")
    }
    # Every case splits K (a workspace without clusters), none needs one with them.
    assert all(ws > 0 for _, ws, _ in runs["0"]), runs["0"]
    assert all(ws == 0 for _, ws, _ in runs["1"]), runs["1"]
    assert [h for _, _, h in runs["0"]] == [h for _, _, h in runs["1"]]


@pytest.mark.parametrize("k,n", [(64, 16), (512, 256), (7168, 2048), (2048, 7168)])
def test_tile_awq_bit_exact(k, n):
    """The CUDA tile repack against the CPU one (itself checked against the layout's
    definition in test_pack.py)."""
    g = torch.Generator().manual_seed(k + n)
    qweight = torch.randint(-(2**31), 2**31, (k, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(forge.tile_awq(qweight.cuda()).cpu(), forge.tile_awq(qweight))


# (m, k, n, group): 16 warps a tile (few tiles, long K), 4 (many tiles), G 64 / 256, a warp
# with a ragged share of groups (7 over 4 warps), the smallest N, K = 64 (one chunk); G = 256 in
# both kernels (M <= 8 and M > 8: several rounds a group).
TILED_CASES = [(1, 7168, 2048, 128), (2, 2048, 7168, 128), (3, 1024, 544, 64), (4, 1792, 48, 256),
               (5, 896, 16, 128), (8, 4096, 1024, 128), (7, 64, 32, 64), (6, 7168, 384, 128),
               (12, 1792, 48, 256)]  # fmt: skip


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,group", TILED_CASES)
def test_tiled_gemv_close_to_reference(act, m, k, n, group):
    """Decode-sized awq_linear calls run the tiled GEMV on the cached tile layout: checked
    against a float64 reference, for determinism, and against the GEMM it replaces."""
    from forge import runtime

    gen = torch.Generator().manual_seed(m * k + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, False, "mse")
    qw, qz, sc = (t.cuda() for t in forge.quantize_pack_awq(w, qmeta, group))
    x = torch.randn(m, k, generator=gen).to(act)
    ref = x.double() @ forge.dequantize_awq(qw, qz, sc, group).double().cpu().t()
    cache: dict = {}
    y = runtime.awq_linear(x.cuda(), qw, qz, sc, group, cache=cache)
    assert "tiled" in cache, "the decode-sized call did not take the tiled GEMV"
    assert torch.equal(cache["tiled"][1].cpu(), forge.tile_awq(qw.cpu()))  # the CPU reference
    assert y.dtype == act and y.shape == (m, n)
    err = float((y.double().cpu() - ref).abs().max() / ref.abs().max())
    assert err < awq_matmul_tol(act), err
    assert torch.equal(runtime.awq_linear(x.cuda(), qw, qz, sc, group, cache=cache), y)
    # the GEMM (N % 32 == 0; other N the dense route); the tiled GEMV takes N % 16 == 0
    y_gemm = forge.awq_matmul(x.cuda(), qw, qz, sc, group)
    assert float((y_gemm.double().cpu() - ref).abs().max() / ref.abs().max()) < awq_matmul_tol(act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# (36, 16, 12): a group size the CPU core does not take (it needs G % 32 == 0)
@pytest.mark.parametrize(
    "k,n,group", [(256, 64, 128), (96, 24, 32), (192, 8, 64), (1024, 4096, 128), (36, 16, 12)]
)
def test_dequantize_awq_dense_bit_exact(k, n, group, dtype):
    """The dense dequantization against the plain-torch formula (test_runtime's), bit for bit, with adversarial
    scales (subnormal, negative, huge: 15 x 60000 overflows float16 to inf, as the fused f16
    kernel's product does); float32 also against the CPU core's ``dequantize_awq``."""
    gen = torch.Generator().manual_seed(k + n)
    qw = torch.randint(-(2**31), 2**31, (k, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    qz = torch.randint(-(2**31), 2**31, (k // group, n // 8), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    sc = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    flat = sc.view(-1)
    flat[1::7] = torch.tensor(3e-7).half()  # subnormal
    flat[3::7] = -flat[3::7] * 50
    flat[5::7] = 6.0e4
    got = forge.dequantize_awq_dense(qw.cuda(), qz.cuda(), sc.cuda(), group, dtype)
    assert got.shape == (k, n) and got.dtype == dtype and got.is_cuda
    want = kernel_weight(qw, qz, sc, group, dtype)
    assert torch.equal(
        got.cpu().view(torch.int32 if dtype == torch.float32 else torch.int16),
        want.view(torch.int32 if dtype == torch.float32 else torch.int16),
    )
    if dtype == torch.float32 and group % 32 == 0:
        cpu = forge.dequantize_awq(qw, qz, sc, group)
        assert torch.equal(got.cpu().t(), cpu)
        assert torch.equal(forge.dequantize_awq(qw.cuda(), qz.cuda(), sc.cuda(), group).cpu(), cpu)


def test_dequantize_awq_dense_refuses_bad_input():
    qw = torch.zeros(64, 2, dtype=torch.int32, device="cuda")
    qz = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    sc = torch.ones(2, 16, dtype=torch.float16, device="cuda")
    from forge.errors import DTypeError, InvalidValueError, ShapeError

    with pytest.raises(ShapeError, match="AWQ tensors"):
        forge.dequantize_awq_dense(qw, qz, sc[:, :8], 32)
    with pytest.raises(DTypeError, match="scales"):
        forge.dequantize_awq_dense(qw, qz, sc.float(), 32)
    with pytest.raises(InvalidValueError, match="group_size"):
        forge.dequantize_awq_dense(qw, qz, sc, 0)
    with pytest.raises(ShapeError, match="AWQ tensors"):
        forge.dequantize_awq_dense(qw[:60], qz, sc, 32)  # K not a multiple of the groups
    # scales as a contiguous view off a 16-byte boundary are copied, not refused
    view = torch.ones(2 * 16 + 1, dtype=torch.float16, device="cuda")[1:].view(2, 16)
    assert view.data_ptr() % 16 and view.is_contiguous()
    assert torch.equal(
        forge.dequantize_awq_dense(qw, qz, view, 32), forge.dequantize_awq_dense(qw, qz, sc, 32)
    )


def test_tiled_decode_switch_and_large_calls(monkeypatch):
    """Calls past TILED_MAX_M rows, shapes the tile layout does not take, and
    TILED_DECODE = False go to the GEMM and leave no tile copy; an in-place change of
    qweight remakes the tile copy."""
    from forge import runtime

    qw = torch.randint(-(2**31), 2**31, (512, 32), dtype=torch.int64).to(torch.int32).cuda()
    qz = torch.randint(-(2**31), 2**31, (4, 32), dtype=torch.int64).to(torch.int32).cuda()
    sc = (torch.rand(4, 256) * 0.01 + 1e-3).half().cuda()
    cache: dict = {}
    past = runtime.TILED_MAX_M + 1
    runtime.awq_linear(torch.randn(past, 512, device="cuda").half(), qw, qz, sc, 128, cache=cache)
    assert "tiled" not in cache
    qz32, sc32 = qz.repeat(4, 1), sc.repeat(4, 1)  # the same codes in groups of 32
    runtime.awq_linear(torch.randn(1, 512, device="cuda").half(), qw, qz32, sc32, 32, cache=cache)
    assert "tiled" not in cache
    monkeypatch.setattr(runtime, "TILED_DECODE", False)
    runtime.awq_linear(torch.randn(1, 512, device="cuda").half(), qw, qz, sc, 128, cache=cache)
    assert "tiled" not in cache
    monkeypatch.setattr(runtime, "TILED_DECODE", True)
    x = torch.randn(1, 512, device="cuda").half()
    y0 = runtime.awq_linear(x, qw, qz, sc, 128, cache=cache)
    first = cache["tiled"][1]
    qw.bitwise_xor_(0x11111111)
    y1 = runtime.awq_linear(x, qw, qz, sc, 128, cache=cache)
    assert cache["tiled"][1] is not first and torch.equal(cache["tiled"][1].cpu(), forge.tile_awq(qw.cpu()))
    assert not torch.equal(y0, y1)
    # x as a contiguous view 2 bytes into its storage (not 16-byte aligned): both paths copy it
    for m in (1, past):
        base = torch.randn(m * 512 + 1, device="cuda").half()
        xv = base[1:].view(m, 512)
        assert xv.data_ptr() % 16
        want = runtime.awq_linear(xv.clone(), qw, qz, sc, 128, cache=cache)
        assert torch.equal(runtime.awq_linear(xv, qw, qz, sc, 128, cache=cache), want)


@pytest.mark.parametrize("path,m", [("tiled", 1), ("tiled", 16), ("gemm", 64), ("gemm", 130)])
def test_w4a16_reads_what_the_previous_kernel_wrote(path, m):
    """On Hopper the wgmma GEMM (M > 16) is launched programmatically: it starts while the
    previous kernel on the stream still runs and waits for it before its first load (the
    tiled GEMV, M <= 16, is launched plainly; a programmatic variant was measured and dropped).
    Back to back, with no synchronisation, x written by a long kernel just before each call
    and the weights changed in place by a kernel between calls (for the tiled path: remade by
    the tile repack, the kernel right before the GEMV): every call must see the new x and the
    new weights (float64 reference of each step's weights)."""
    from forge import runtime

    k, n, group, steps = 2048, 1024, 128, 5
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen) * 0.05
    qmeta, _, _ = forge.build_quant_grid(w, group, 4, False, "range")
    qw, qz, sc = (t.cuda() for t in forge.quantize_pack_awq(w, qmeta, group))
    masks = torch.randint(1, 2**31, (steps,), generator=gen).tolist()
    big = 1 << 25  # x is the tail of a 64 MB buffer, written by the kernel before the call
    src = torch.randn(steps, big, generator=gen).to(torch.bfloat16).cuda()
    xbuf = torch.empty(big, dtype=torch.bfloat16, device="cuda")
    x = xbuf[-m * k :].view(m, k)
    cache: dict = {}
    torch.cuda.synchronize()
    ys = []
    for i in range(steps):
        qw.bitwise_xor_(masks[i])
        torch.mul(src[i], 1.0, out=xbuf)
        y = (
            runtime.awq_linear(x, qw, qz, sc, group, cache=cache)
            if path == "tiled"
            else forge.awq_matmul(x, qw, qz, sc, group)
        )
        ys.append(y)
    torch.cuda.synchronize()
    assert ("tiled" in cache) == (path == "tiled")
    qw_i = qw.cpu()
    for mask in masks:
        qw_i ^= mask  # back to the original codes
    for i in range(steps):
        qw_i ^= masks[i]
        ref = (
            src[i, -m * k :].view(m, k).double().cpu()
            @ forge.dequantize_awq(qw_i, qz.cpu(), sc.cpu(), group).double().t()
        )
        err = float((ys[i].double().cpu() - ref).abs().max() / ref.abs().max())
        assert err < awq_matmul_tol(torch.bfloat16), (i, err)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("experts", [1, 3])
@pytest.mark.parametrize("k", [384, 640])  # 640: past the CUDA solver's 512-column super-block
def test_gptq_batched_matches_cpu(act_order, experts, k):
    g = torch.Generator().manual_seed(4)
    n, group = 192, 128
    ws, hs = [], []
    for _ in range(experts):
        x = torch.randn(1024, 8, generator=g) @ torch.randn(8, k, generator=g) + 0.3 * torch.randn(
            1024, k, generator=g
        )
        hs.append(2 * x.T @ x / x.shape[0])
        ws.append(torch.randn(n, k, generator=g) * 0.1)
    h = torch.stack(hs)
    w = torch.stack(ws)
    qm = torch.stack([forge.build_quant_grid(wi, group, 4, False, "range")[0] for wi in ws])
    u, perm, _, _, _ = forge.prepare_hessian_batched(h, 0.01, act_order)
    wt = w.transpose(1, 2).contiguous()
    codes_cpu, deq_cpu = forge.gptq_solve_batched(wt, u, qm, 4, group, 128, perm)
    codes_gpu, deq_gpu = forge.gptq_solve_batched(
        wt.cuda(), u.cuda(), qm.cuda(), 4, group, 128, None if perm is None else perm.cuda()
    )
    agree = (codes_gpu.cpu() == codes_cpu).float().mean()
    assert agree >= 0.999, float(agree)
    # layer error of the GPU result equals the CPU one to 1 %
    for i in range(experts):
        e_cpu = float(torch.trace((w[i].T - deq_cpu[i]).T @ h[i] @ (w[i].T - deq_cpu[i])))
        d = deq_gpu[i].cpu()
        e_gpu = float(torch.trace((w[i].T - d).T @ h[i] @ (w[i].T - d)))
        assert abs(e_gpu - e_cpu) <= 0.01 * e_cpu


def test_prepare_hessian_gpu_matches_cpu():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 96, generator=g)
    h = 2 * x.T @ x / 512
    h[7, :] = 0
    h[:, 7] = 0
    for act_order in (False, True):
        a = forge.prepare_hessian(h, 0.01, act_order)
        b = forge.prepare_hessian(h.cuda(), 0.01, act_order)
        assert b.dead == a.dead == 1
        torch.testing.assert_close(b.hinv_chol.cpu(), a.hinv_chol, rtol=1e-3, atol=1e-4)
        if act_order:
            assert torch.equal(b.perm.cpu(), a.perm)


def test_prepare_hessian_batched_streams_match_cpu(monkeypatch):
    """A batch spread over several CUDA streams (C = 2200 > 2048: one matrix per group; one
    matrix indefinite, retried with more damping) gives the float64 reference's factors
    (``U`` upper with ``UᵀU = (H + damp I)⁻¹``, damp = 1 % of the mean diagonal x 10^retries,
    computed here), the CPU's, and exactly the same floats as one stream (same kernels, same
    inputs)."""
    import forge.quant as q

    g = torch.Generator().manual_seed(6)
    c = 2200
    hs = []
    for _ in range(5):
        x = torch.randn(2 * c, c, generator=g) * torch.rand(c, generator=g)
        hs.append(2 * x.T @ x / x.shape[0])
    off = 3 * float(hs[3][0, 0] * hs[3][1, 1]) ** 0.5  # a 2 x 2 minor [[a, o], [o, b]], o² > ab
    hs[3][0, 1] = hs[3][1, 0] = off  # indefinite: needs damping
    h = torch.stack(hs)
    u_cpu, _, damp_cpu, retries_cpu, _ = forge.prepare_hessian_batched(h, 0.01)
    assert retries_cpu[3] > 0 and retries_cpu[0] == 0
    runs = {}
    for streams in (1, 4):
        monkeypatch.setattr(q, "PREPARE_STREAMS", streams)
        runs[streams] = forge.prepare_hessian_batched(h.cuda(), 0.01)
    u1, _, damp1, retries1, _ = runs[1]
    u4, _, damp4, retries4, _ = runs[4]
    assert torch.equal(u1, u4) and damp1 == damp4 and retries1 == retries4 == retries_cpu
    assert damp4 == pytest.approx(damp_cpu, rel=1e-6)
    for i in range(len(hs)):
        err = torch.linalg.norm(u4[i].cpu().double() - u_cpu[i].double()) / torch.linalg.norm(
            u_cpu[i].double()
        )
        assert err < 1e-3, (i, float(err))
        hd = hs[i].double()
        damp = 0.01 * float(hd.diagonal().mean()) * 10 ** retries4[i]
        assert damp4[i] == pytest.approx(damp, rel=1e-5)
        u_ref = torch.linalg.cholesky(
            torch.linalg.inv(hd + damp * torch.eye(c, dtype=torch.float64)), upper=True
        )
        err = torch.linalg.norm(u4[i].cpu().double() - u_ref) / torch.linalg.norm(u_ref)
        assert err < 1e-3, (i, float(err))


def test_prepare_hessian_batched_repeatable_at_deepseek_width():
    """Identical calls give identical factors, bit for bit, at C = 7168 (DeepSeek's expert
    input) where the matrices are factorised concurrently on several streams: with one
    cuSOLVER handle shared by the streams, repeated calls differed by an ulp."""
    g = torch.Generator(device="cuda").manual_seed(3)
    c, e = 7168, 8
    h = torch.empty(e, c, c, device="cuda")
    for i in range(e):
        x = torch.randn(2 * c, c, device="cuda", generator=g, dtype=torch.bfloat16)
        h[i] = torch.mm(x.t(), x, out_dtype=torch.float32) / (2 * c)
    del x
    first = forge.prepare_hessian_batched(h, 0.01)[0]
    for _ in range(3):
        again = forge.prepare_hessian_batched(h, 0.01)[0]
        assert torch.equal(again, first), float((again - first).abs().max())
        del again


def test_prepare_hessian_batched_first_calls_from_two_threads():
    """Two host threads making a fresh process's first preparations at the same moment (both
    making the lanes and torch's lazy linear-algebra state) get the factors one thread alone
    gets afterwards, bit for bit, those of the float64 definition, and the process made each
    lane once."""
    script = (
        "import threading, torch, forge\n"
        "from forge import quant\n"
        "g = torch.Generator().manual_seed(5)\n"
        "hs = []\n"
        "for _ in range(2):\n"
        "    x = torch.randn(4, 4400, 2200, generator=g)\n"
        "    hs.append((torch.bmm(x.transpose(1, 2), x) / 4400).cuda())\n"
        "go, got, errs = threading.Barrier(2), [None, None], []\n"
        "def run(i):\n"
        "    try:\n"
        "        go.wait()\n"
        "        got[i] = forge.prepare_hessian_batched(hs[i], 0.01)[0]\n"
        "    except BaseException as e:\n"
        "        errs.append(repr(e))\n"
        "ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "assert not errs, errs\n"
        "for i in range(2):\n"
        "    again = forge.prepare_hessian_batched(hs[i], 0.01)[0]\n"
        "    assert torch.equal(again, got[i]), (i, float((again - got[i]).abs().max()))\n"
        "    for m in range(hs[i].shape[0]):\n"  # against float64: U = chol((H + damp I)^-1)
        "        hd = hs[i][m].double().cpu()\n"
        "        hd += 0.01 * float(hd.diagonal().mean()) * torch.eye(hd.shape[0], dtype=torch.float64)\n"
        "        ref = torch.linalg.cholesky(torch.linalg.inv(hd), upper=True)\n"
        "        err = torch.linalg.norm(got[i][m].cpu().double() - ref) / torch.linalg.norm(ref)\n"
        "        assert err < 1e-3, (i, m, float(err))\n"
        "lanes = [l for ls in quant._LANES.values() for l in ls]\n"
        "assert len({id(s) for _, s in lanes}) == len(lanes) == 2, len(lanes)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.parametrize("c,e", [(1024, 32), (2200, 6)])
def test_prepare_hessian_batched_memory_within_twice_the_hessians(c, e):
    """Preparation's peak memory above its input, the result included, stays within 2x the
    Hessians being prepared (the factorisation, inverse and reversal run in the result's own
    slices), for the whole-batch groups (C <= 2048) and the one-a-stream groups (C > 2048);
    and the factors are still those of the float64 definition."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(e, 2 * c, c, generator=g)
    h = (torch.bmm(x.transpose(1, 2), x) / x.shape[1]).cuda()
    del x
    # Once a process: every stream's host thread, cuSOLVER / cuBLAS handles and workspaces
    # (a fixed cost, ~40 MB a stream on an H100, which at this small size alone would pass the
    # bound).
    forge.prepare_hessian_batched(h, 0.01)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    u, _, damp, retries, _ = forge.prepare_hessian_batched(h, 0.01)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 2 * h.numel() * 4, extra / (h.numel() * 4)
    assert retries == [0] * e
    for i in (0, e - 1):
        hd = h[i].double().cpu() + damp[i] * torch.eye(c, dtype=torch.float64)
        u_ref = torch.linalg.cholesky(torch.linalg.inv(hd), upper=True)
        err = torch.linalg.norm(u[i].cpu().double() - u_ref) / torch.linalg.norm(u_ref)
        assert err < 1e-3, (i, float(err))


@pytest.mark.parametrize("t,d", [(300, 200), (4096, 2100), (16384, 2100), (16384, 12352)])
def test_gram_blocks_match_float64(t, d):
    """calibrate.gram (one product, or from SYMMETRIC_ROWS rows the upper row panels on
    tensor cores, mirrored) is XᵀX of the bf16 values with fp32 accumulation: symmetric, and
    within fp32 rounding of float64."""
    from forge.calibrate import SYMMETRIC_ROWS, gram

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(t, d, generator=g) * torch.rand(d, generator=g)).bfloat16().cuda()
    got = gram(x)
    ref = x.double().T @ x.double()
    assert got.dtype == torch.float32
    if t >= SYMMETRIC_ROWS:
        assert torch.equal(got, got.T)
    else:
        assert float((got - got.T).abs().max()) <= 1e-6 * float(got.abs().max())
    # fp32 accumulation of t terms: within t·2⁻²⁴ of the largest entry (the worst-case bound;
    # tensor cores measure ~10x under it), e.g. 9.8e-4 at 16384 rows.
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < max(t, 128) * 2.0**-24


@pytest.mark.parametrize("t,d", [(3000, 4104), (8192, 2048), (16384, 4096)])
def test_add_gram_matches_float64(t, d):
    """calibrate.add_gram (forge's Hopper kernel in place for D >= KERNEL_MIN_D below
    SYMMETRIC_ROWS rows, else gram added) accumulates XᵀX onto H within fp32 rounding of
    float64; the kernel's H stays exactly symmetric."""
    from forge.calibrate import KERNEL_MIN_D, SYMMETRIC_ROWS, add_gram

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(t, d, generator=g) * torch.rand(d, generator=g)).bfloat16()
    base = torch.randn(d, d, generator=g)
    base = base + base.T
    h = base.cuda()
    add_gram(h, x.cuda())
    add_gram(h, x[: t // 3].cuda())
    xd = x.double()
    ref = base.double() + xd.T @ xd + xd[: t // 3].T @ xd[: t // 3]
    assert float((h.cpu().double() - ref).abs().max() / ref.abs().max()) < max(t, 128) * 2.0**-24
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper and d >= KERNEL_MIN_D and t < SYMMETRIC_ROWS:
        assert torch.equal(h, h.T)


def test_hessian_kernel_choice_and_unchecked_inputs():
    """``_native.hessian_kernel`` names the kernel ``hessian_update`` runs (Hopper: wgmma for
    16-bit rows with D % 8 == 0 and a 16-byte aligned H; mma.sync for an H only 4-byte aligned
    or another GPU; the fp32 SIMT kernel for float32 rows). ``check_finite=False`` skips the scan
    of x: a NaN is then added, and shows on the diagonal, where the run looks for it."""
    d = 64
    x = torch.randn(32, d, device="cuda").bfloat16()
    h = torch.zeros(d, d, device="cuda")
    hm = torch.zeros(d * d + 1, device="cuda")[1:].view(d, d)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert forge._native.hessian_kernel(h, x) == ("wgmma" if hopper else "mma_sync")
    assert forge._native.hessian_kernel(hm, x) == "mma_sync"
    assert forge._native.hessian_kernel(h, x.float()) == "simt"
    assert forge._native.hessian_kernel(h.cpu(), x.cpu()) == "cpu"
    x[3, 5] = float("nan")
    with pytest.raises(forge.errors.InvalidValueError, match="x"):
        forge.hessian_update(h, x)
    forge.hessian_update(h, x, check_finite=False)
    assert bool(torch.isnan(h[5, 5])) and bool(torch.isfinite(h[0, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hessian_update_and_segments(dtype):
    g = torch.Generator().manual_seed(6)
    t, d, e = 300, 200, 4
    x = torch.randn(t, d, generator=g).to(dtype)
    h = torch.zeros(d, d, device="cuda")
    forge.hessian_update(h, x.cuda(), 0.5)
    ref = 0.5 * x.double().T @ x.double()
    torch.testing.assert_close(h.double().cpu(), ref, rtol=1e-4, atol=1e-3)
    idx = torch.randperm(t, generator=g)[:250].to(torch.int32)
    offsets = torch.tensor([0, 60, 60, 200, 250], dtype=torch.int32)
    hs = torch.zeros(e, d, d, device="cuda")
    forge.hessian_update_segmented(hs, x.cuda(), idx.cuda(), offsets.cuda(), 1.0)
    for i in range(e):
        xe = x[idx[offsets[i] : offsets[i + 1]].long()].double()
        torch.testing.assert_close(hs[i].double().cpu(), xe.T @ xe, rtol=1e-4, atol=1e-3)
    # A NaN in a routed row: refused by the default check (H untouched); with
    # check_finite=False it shows on its expert's diagonal only.
    xn = x.clone()
    row = int(idx[70])  # routed to expert 2 (positions 60..200)
    xn[row, 7] = float("nan")
    before = hs.clone()
    with pytest.raises(forge.errors.InvalidValueError, match="x"):
        forge.hessian_update_segmented(hs, xn.cuda(), idx.cuda(), offsets.cuda(), 1.0)
    assert torch.equal(hs, before)
    forge.hessian_update_segmented(hs, xn.cuda(), idx.cuda(), offsets.cuda(), 1.0, check_finite=False)
    assert bool(torch.isnan(hs[2, 7, 7]))
    assert bool(torch.isfinite(hs[0]).all()) and bool(torch.isfinite(hs[3]).all())
    # No routed rows at all: nothing to add (an empty idx has no device pointer). Compared
    # bit for bit: hs[2] holds the NaN put there above.
    before = hs.clone()
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    forge.hessian_update_segmented(
        hs, x.cuda(), empty, torch.zeros(e + 1, dtype=torch.int32, device="cuda"), 1.0
    )
    assert torch.equal(hs.view(torch.int32), before.view(torch.int32))
    bad = idx.clone()
    bad[5] = t
    with pytest.raises(forge.errors.InvalidValueError, match="idx"):
        forge.hessian_update_segmented(hs, x.cuda(), bad.cuda(), offsets.cuda(), 1.0, check_finite=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_update_segmented_overwrite_matches_adding_into_zeros(dtype):
    """``overwrite=True`` on the GPU (bf16: the Hopper kernel writing straight from its
    accumulators, several tile groups, partial and diagonal tiles; float32: the SIMT kernel):
    over an H full of NaN, bit for bit what adding into zeros gives, zeros for an expert
    without rows, within fp32 rounding of float64, exactly symmetric."""
    g = torch.Generator().manual_seed(13)
    t, d = 777, 1032
    x = torch.randn(t, d, generator=g).to(dtype)
    counts = [200, 0, 63, 65, 1, 448]
    idx = torch.randperm(t, generator=g)[: sum(counts)].to(torch.int32)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    xc, ic, oc = x.cuda(), idx.cuda(), offsets.cuda()
    fresh = torch.full((len(counts), d, d), float("nan"), device="cuda")
    forge.hessian_update_segmented(fresh, xc, ic, oc, 0.5, overwrite=True)
    added = torch.zeros(len(counts), d, d, device="cuda")
    forge.hessian_update_segmented(added, xc, ic, oc, 0.5)
    assert torch.equal(fresh.view(torch.int32), added.view(torch.int32))
    assert not fresh[1].any()
    xd = x.double()
    for i in range(len(counts)):
        xe = xd[idx[offsets[i] : offsets[i + 1]].long()]
        ref = 0.5 * xe.T @ xe
        got = fresh[i].cpu().double()
        assert torch.equal(fresh[i], fresh[i].T)
        if counts[i]:
            err = float((got - ref).abs().max() / ref.abs().max())
            assert err < max(counts[i], 128) * 2.0**-24, (i, err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hessian_update_tensor_cores_large(dtype):
    """The tensor-core path (on Hopper the warp-specialized 128 × 256 tile kernel: several tile
    groups, partial tiles, diagonal tiles, segments that end inside a 64-row stage, an empty
    one) adds alpha · XᵀX to a non-zero H within fp32 rounding of float64 and keeps it exactly
    symmetric; an H that is not 16-byte aligned (another kernel) gets the same sums."""
    g = torch.Generator().manual_seed(12)
    t, d = 777, 1032
    x = (torch.randn(t, d, generator=g) * torch.rand(d, generator=g)).to(dtype)
    base = torch.randn(d, d, generator=g)
    base = base + base.T
    xd = x.double()

    def check(got, ref, rows):
        assert torch.equal(got, got.T)
        err = float((got.cpu().double() - ref).abs().max() / ref.abs().max())
        assert err < max(rows, 128) * 2.0**-24, err

    h = base.cuda()
    forge.hessian_update(h, x.cuda(), 0.25)
    check(h, base.double() + 0.25 * xd.T @ xd, t)
    # The same sums into a 4-byte-offset H.
    buf = torch.zeros(d * d + 1, device="cuda")
    hm = buf[1:].view(d, d)
    hm.copy_(base)
    forge.hessian_update(hm, x.cuda(), 0.25)
    check(hm, base.double() + 0.25 * xd.T @ xd, t)
    assert float((hm - h).abs().max()) <= 1e-5 * float(h.abs().max())
    counts = [200, 0, 63, 65, 449]
    idx = torch.randperm(t, generator=g)[: sum(counts)].to(torch.int32)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    hs = base.expand(len(counts), d, d).contiguous().cuda()
    forge.hessian_update_segmented(hs, x.cuda(), idx.cuda(), offsets.cuda(), 1.0)
    for i in range(len(counts)):
        xe = xd[idx[offsets[i] : offsets[i + 1]].long()]
        check(hs[i], base.double() + xe.T @ xe, max(counts[i], 1))


def test_cuda_rejects_bad_input():
    w = torch.randn(8, 64, device="cuda")
    w[3, 5] = float("nan")
    with pytest.raises(forge.errors.InvalidValueError, match="weight"):
        forge.build_quant_grid(w, 32)
    qmeta, _, _ = forge.build_quant_grid(torch.randn(8, 64), 32)
    with pytest.raises(forge.errors.DeviceError, match="qmeta"):
        forge.quantize_pack_awq(torch.randn(8, 64, device="cuda"), qmeta, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, -1, 1000])
def test_cuda_finiteness_check_finds_one_bad_element(dtype, bad, where):
    """One NaN or Inf anywhere (first, last or inner element) of a CUDA input is refused,
    naming the input; the same input without it passes (large finite values included)."""
    w = torch.randn(16, 128, device="cuda").to(dtype)
    w[0, 0] = torch.finfo(dtype).max
    w[1, 1] = -torch.finfo(dtype).max
    forge.build_quant_grid(w, 32)
    w.view(-1)[where] = bad
    with pytest.raises(forge.errors.InvalidValueError, match="weight"):
        forge.build_quant_grid(w, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, -1, 1000])
def test_gptq_batched_refuses_one_bad_element(bad, where):
    """The batched GPTQ solve checks ``weight_t`` and ``hinv_chol`` (here float32) the same way."""
    e, c, r = 2, 64, 32
    wt = torch.randn(e, c, r, device="cuda")
    u = torch.eye(c, device="cuda").expand(e, c, c).contiguous()
    qm = torch.stack([forge.build_quant_grid(wt[i].T.contiguous(), 32)[0] for i in range(e)])
    forge.gptq_solve_batched(wt, u, qm, 4, 32, 32)
    for name, t in (("weight_t", wt), ("hinv_chol", u)):
        t2 = t.clone()
        t2.view(-1)[where] = bad
        args = (t2, u) if name == "weight_t" else (wt, t2)
        with pytest.raises(forge.errors.InvalidValueError, match=name):
            forge.gptq_solve_batched(*args, qm, 4, 32, 32)


def test_cuda_fp8_nan_byte_refused():
    w = torch.randn(16, 128, device="cuda").to(torch.float8_e4m3fn)
    forge.build_quant_grid(w, 32)
    for byte in (0x7F, 0xFF):
        bad = w.clone()
        bad.view(torch.uint8)[5, 77] = byte
        with pytest.raises(forge.errors.InvalidValueError, match="weight"):
            forge.build_quant_grid(bad, 32)


def test_quantize_model_on_cuda_is_byte_identical(tmp_path):
    """A whole (tiny) checkpoint quantized on the GPU gives the same files as on the CPU."""
    from tiny_models import make_fp8_variant, make_model

    bf16 = make_model("deepseek", tmp_path / "src")
    fp8 = make_fp8_variant(bf16, tmp_path / "src-fp8")
    for src, grid in ((bf16, "range"), (bf16, "mse"), (fp8, "range"), (fp8, "mse")):
        cpu, gpu = tmp_path / f"cpu-{src.name}-{grid}", tmp_path / f"gpu-{src.name}-{grid}"
        forge.quantize_model(src, cpu, grid=grid, group_size=32, progress=False)
        forge.quantize_model(src, gpu, grid=grid, group_size=32, progress=False, device="cuda")
        names = sorted(p.name for p in cpu.iterdir())
        assert names == sorted(p.name for p in gpu.iterdir())
        for name in names:
            assert (cpu / name).read_bytes() == (gpu / name).read_bytes(), name
