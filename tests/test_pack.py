"""AWQ / GPTQ v1 packing bit-exact against plain Python loops over nibbles, dequant, matmul."""

from __future__ import annotations

import pytest
import torch
from conftest import ref_dequant_codes, ref_rtn_codes, ref_scale_of, ref_zero_of

import forge
from forge.errors import InvalidValueError

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _i32(word: int) -> int:
    """uint32 bit pattern -> the int32 torch stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def loop_pack_awq_rows(v: list[list[int]]) -> list[list[int]]:
    """Nibble i of word [r, c] holds column 8c + AWQ_ORDER[i]."""
    out = []
    for row in v:
        words = []
        for c in range(len(row) // 8):
            w = 0
            for i in range(8):
                w |= (row[8 * c + AWQ_ORDER[i]] & 0xF) << (4 * i)
            words.append(_i32(w))
        out.append(words)
    return out


def loop_pack_gptq_qweight(codes: list[list[int]]) -> list[list[int]]:
    """Row 8r+i of codes (K, N) at bits 4i of row r."""
    k, n = len(codes), len(codes[0])
    return [
        [_i32(sum((codes[8 * r + i][col] & 0xF) << (4 * i) for i in range(8))) for col in range(n)]
        for r in range(k // 8)
    ]


def loop_pack_plain_rows(v: list[list[int]]) -> list[list[int]]:
    """Plain order along the row: column 8c+i at bits 4i of word c."""
    return [
        [_i32(sum((row[8 * c + i] & 0xF) << (4 * i) for i in range(8))) for c in range(len(row) // 8)]
        for row in v
    ]


def _layer(k: int, n: int, g: int, gen: torch.Generator, symmetric=False, mode="range"):
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0.5, n).unsqueeze(1)
    qmeta = forge.build_quant_grid(w, g, 4, symmetric, mode)[0]
    return w, qmeta


def _zeros_kn(qmeta: torch.Tensor) -> torch.Tensor:
    """Zero points (K/G, N) int64 that the layouts store (symmetric -> 8)."""
    return ref_zero_of(qmeta, 4).T.to(torch.int64)


def _scales16(qmeta: torch.Tensor) -> torch.Tensor:
    return ref_scale_of(qmeta).T.to(torch.float16)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k, n, g", [(64, 32, 32), (128, 16, 64), (256, 8, 128), (256, 24, 256)])
def test_pack_awq_bit_exact(k, n, g, symmetric, gen):
    w, qmeta = _layer(k, n, g, gen, symmetric)
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=gen)
    qweight, qzeros, scales = forge.pack_awq(codes, qmeta, g)
    assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // g, n // 8) and scales.shape == (k // g, n)
    assert qweight.tolist() == loop_pack_awq_rows(codes.tolist())
    zeros = _zeros_kn(qmeta)
    if symmetric:
        assert torch.all(zeros == 8)
    assert qzeros.tolist() == loop_pack_awq_rows(zeros.tolist())
    # scales = fp16(decode(qmeta)), round to nearest even
    assert torch.equal(scales, _scales16(qmeta))


def test_awq_known_word():
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8).repeat(32, 1)
    qmeta = forge.encode_qmeta(torch.full((8, 1), 0.25), torch.full((8, 1), 3, dtype=torch.uint8), False)
    qweight, qzeros, scales = forge.pack_awq(codes, qmeta, 32)
    assert torch.all(qweight == 0x75316420)
    assert qzeros.item() == 0x33333333
    assert torch.all(scales == 0.25)
    c, z = forge.unpack_awq(qweight, qzeros, 32)
    assert torch.equal(c, codes) and torch.all(z == 3)


@pytest.mark.parametrize("k, n, g", [(64, 32, 32), (256, 16, 128), (512, 8, 256)])
def test_awq_unpack_inverts_pack(k, n, g, gen):
    _, qmeta = _layer(k, n, g, gen)
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=gen)
    qweight, qzeros, scales = forge.pack_awq(codes, qmeta, g)
    c, z = forge.unpack_awq(qweight, qzeros, g)
    assert torch.equal(c, codes)
    assert torch.equal(z.to(torch.int64), _zeros_kn(qmeta))
    # unpack of arbitrary words (every bit pattern, negative int32 included) round-trips
    words = torch.randint(-(2**31), 2**31, (k, n // 8), dtype=torch.int64, generator=gen).to(torch.int32)
    zw = torch.randint(-(2**31), 2**31, (k // g, n // 8), dtype=torch.int64, generator=gen).to(torch.int32)
    c2, z2 = forge.unpack_awq(words, zw, g)
    assert torch.equal(forge.pack_awq(c2, qmeta, g)[0], words)
    assert loop_pack_awq_rows(z2.tolist()) == zw.tolist()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k, n, g", [(64, 32, 32), (256, 16, 128), (256, 8, 64)])
def test_pack_gptq_bit_exact(k, n, g, symmetric, gen):
    w, qmeta = _layer(k, n, g, gen, symmetric)
    zeros = _zeros_kn(qmeta)
    if not symmetric and torch.any(zeros == 0):
        qmeta[..., 2] = qmeta[..., 2].clamp(min=1)  # v1 cannot store zero point 0
        zeros = _zeros_kn(qmeta)
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=gen)
    qweight, qzeros, scales, g_idx = forge.pack_gptq(codes, qmeta, g)
    assert qweight.shape == (k // 8, n) and qweight.dtype == torch.int32
    assert qzeros.shape == (k // g, n // 8) and qzeros.dtype == torch.int32
    assert scales.shape == (k // g, n) and scales.dtype == torch.float16
    assert g_idx.dtype == torch.int32 and g_idx.tolist() == [i // g for i in range(k)]
    assert qweight.tolist() == loop_pack_gptq_qweight(codes.tolist())
    assert qzeros.tolist() == loop_pack_plain_rows((zeros - 1).tolist())
    if symmetric:
        assert torch.all(qzeros == 0x77777777)
    assert torch.equal(scales, _scales16(qmeta))
    c, z = forge.unpack_gptq(qweight, qzeros, g)
    assert torch.equal(c, codes) and torch.equal(z.to(torch.int64), zeros)


def test_pack_gptq_rejects_zero_point_zero():
    qmeta = forge.encode_qmeta(torch.full((8, 2), 0.1), torch.full((8, 2), 5, dtype=torch.uint8), False)
    qmeta[3, 1, 2] = 0
    codes = torch.zeros(64, 8, dtype=torch.uint8)
    with pytest.raises(InvalidValueError, match="zero"):
        forge.pack_gptq(codes, qmeta, 32)
    forge.pack_awq(codes, qmeta, 32)  # AWQ stores 0 fine


def test_dequantize_awq_matches_reference(gen):
    k, n, g = 256, 32, 64
    w, qmeta = _layer(k, n, g, gen, mode="range")
    codes = forge.quantize_rtn(w, qmeta, 4, g)
    qweight, qzeros, scales = forge.pack_awq(codes, qmeta, g)
    deq = forge.dequantize_awq(qweight, qzeros, scales, g)
    assert deq.dtype == torch.float32 and deq.shape == (n, k)
    gi = torch.arange(k) // g
    ref = (codes.T.float() - _zeros_kn(qmeta).T[:, gi].float()) * scales.T[:, gi].float()
    assert torch.equal(deq, ref)
    # close to the float32-scale dequant (fp16 rounding of the scale only) and to W
    ref32 = ref_dequant_codes(codes.T, qmeta, 4, g)
    assert torch.allclose(deq, ref32, rtol=2**-11, atol=0)
    s = ref_scale_of(qmeta)[:, gi]
    # range grid: every value is inside the grid up to the rounding of z and of the scale
    assert torch.all((deq - w).abs() <= 0.55 * s)


def test_dequantize_gptq_matches_reference_and_honours_g_idx(gen):
    k, n, g = 128, 16, 32
    w, qmeta = _layer(k, n, g, gen, symmetric=True)
    codes = forge.quantize_rtn(w, qmeta, 4, g)
    qweight, qzeros, scales, g_idx = forge.pack_gptq(codes, qmeta, g)
    deq = forge.dequantize_gptq(qweight, qzeros, scales, g_idx, g)
    assert deq.shape == (n, k)
    gi = g_idx.long()
    ref = (codes.T.float() - 8.0) * scales.T[:, gi].float()
    assert torch.equal(deq, ref)
    # a different g_idx (e.g. from desc_act) is used as given
    g2 = torch.randint(0, k // g, (k,), dtype=torch.int32, generator=gen)
    deq2 = forge.dequantize_gptq(qweight, qzeros, scales, g2, g)
    assert torch.equal(deq2, (codes.T.float() - 8.0) * scales.T[:, g2.long()].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_pack_awq_equals_rtn_then_pack(dtype, symmetric, gen):
    k, n, g = 256, 24, 64
    w, _ = _layer(k, n, g, gen)
    w = w.to(dtype)
    qmeta = forge.build_quant_grid(w, g, 4, symmetric, "mse")[0]
    fused = forge.quantize_pack_awq(w, qmeta, g)
    codes = forge.quantize_rtn(w, qmeta, 4, g)
    two_step = forge.pack_awq(codes, qmeta, g)
    for a, b in zip(fused, two_step, strict=True):
        assert torch.equal(a, b)
    # and the codes are the plain-PyTorch round-half-even RTN
    assert torch.equal(codes.T.float(), ref_rtn_codes(w.float(), qmeta, 4, g))
    assert fused[0].tolist() == loop_pack_awq_rows(ref_rtn_codes(w.float(), qmeta, 4, g).T.long().tolist())


def _fp8_with_block_scales(
    n: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An FP8 weight, DeepSeek-style block scales (partial edge blocks) and the f32 weight
    they stand for, computed here element by element from the definition."""
    w8 = (torch.randn(n, k, generator=gen) * 40).clamp(-440, 440).to(torch.float8_e4m3fn)
    s = 10 ** (torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 4 - 3)
    rows = torch.arange(n)[:, None] // 128
    cols = torch.arange(k)[None, :] // 128
    return w8, s, w8.float() * s[rows, cols]


@pytest.mark.parametrize("group,k", [(32, 320), (128, 384)])  # 320: a partial column block
def test_block_scaled_fp8_grid_and_pack_equal_the_dequantized_weight(group, k, gen):
    """``scale_inv`` makes an FP8 weight ``e4m3 · scale[r // 128, c // 128]``: the grid (range
    and MSE) and the fused pack equal those of that f32 weight, and the codes are its
    plain-PyTorch RTN codes."""
    n = 264  # three row blocks, the last one partial
    w8, s, w = _fp8_with_block_scales(n, k, gen)
    for mode in ("range", "mse"):
        got = forge.build_quant_grid(w8, group, 4, False, mode, scale_inv=s)[0]
        assert torch.equal(got, forge.build_quant_grid(w, group, 4, False, mode)[0])
    qmeta = forge.build_quant_grid(w, group, 4, False, "range")[0]
    packed = forge.quantize_pack_awq(w8, qmeta, group, scale_inv=s)
    for a, b in zip(packed, forge.quantize_pack_awq(w, qmeta, group), strict=True):
        assert torch.equal(a, b)
    assert packed[0].tolist() == loop_pack_awq_rows(ref_rtn_codes(w, qmeta, 4, group).T.long().tolist())


def test_block_scales_are_checked(gen):
    from forge.errors import DTypeError, ShapeError

    w8, s, w = _fp8_with_block_scales(136, 256, gen)
    qmeta = forge.build_quant_grid(w, 128, 4, False, "range")[0]
    with pytest.raises(DTypeError, match="scale_inv.*float8_e4m3fn weight"):
        forge.quantize_pack_awq(w, qmeta, 128, scale_inv=s)
    with pytest.raises(ShapeError, match=r"scale_inv: expected shape \[2, 2\]"):
        forge.build_quant_grid(w8, 128, scale_inv=s[:1])
    with pytest.raises(DTypeError, match="scale_inv: expected dtype torch.float32"):
        forge.quantize_pack_awq(w8, qmeta, 128, scale_inv=s.half())
    bad = s.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(InvalidValueError, match="scale_inv"):
        forge.build_quant_grid(w8, 128, scale_inv=bad)


def test_rtn_round_half_even():
    # x / s + z lands exactly on .5: ties go to the even code
    qmeta = forge.encode_qmeta(torch.full((8, 1), 1.0), torch.full((8, 1), 8, dtype=torch.uint8), False)
    vals = torch.tensor([-7.5, -6.5, -0.5, 0.5, 1.5, 2.5, 3.5, 6.5])
    w = vals.view(8, 1).repeat(1, 32)
    codes = forge.quantize_rtn(w, qmeta, 4, 32)
    want = torch.round(vals + 8).to(torch.uint8)
    assert want.tolist() == [0, 2, 8, 8, 10, 10, 12, 14]
    assert torch.equal(codes[0], want)
    assert torch.equal(forge.unpack_awq(*forge.quantize_pack_awq(w, qmeta, 32)[:2], 32)[0][0], want)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_awq_matmul_matches_dense(x_dtype, gen):
    k, n, g = 256, 32, 128
    w, qmeta = _layer(k, n, g, gen)
    qweight, qzeros, scales = forge.quantize_pack_awq(w, qmeta, g)
    deq = forge.dequantize_awq(qweight, qzeros, scales, g)
    x = torch.randn(3, 5, k, generator=gen).to(x_dtype)
    y = forge.awq_matmul(x, qweight, qzeros, scales, g)
    assert y.shape == (3, 5, n) and y.dtype == x_dtype
    ref = (x.double() @ deq.double().T).to(x_dtype)
    tol = 1e-4 if x_dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), ref.double(), rtol=tol, atol=tol)


def test_pack_rejects_codes_above_15(gen):
    _, qmeta = _layer(64, 8, 32, gen)
    codes = torch.randint(0, 16, (64, 8), dtype=torch.uint8, generator=gen)
    codes[5, 3] = 16
    with pytest.raises(InvalidValueError, match="codes"):
        forge.pack_awq(codes, qmeta, 32)
    with pytest.raises(InvalidValueError, match="codes"):
        forge.pack_gptq(codes, qmeta, 32)


@pytest.mark.parametrize("packer", ["pack_awq", "pack_gptq", "quantize_pack_awq"])
def test_pack_rejects_zero_point_above_15(packer):
    # e.g. a grid built with bits=8 handed to the 4-bit packers
    qmeta = forge.encode_qmeta(torch.full((8, 1), 0.01), torch.full((8, 1), 20, dtype=torch.uint8), False)
    arg = torch.zeros(32, 8, dtype=torch.uint8) if packer != "quantize_pack_awq" else torch.zeros(8, 32)
    with pytest.raises(ValueError, match="zero|qmeta"):
        getattr(forge, packer)(arg, qmeta, 32)


def ref_tile_awq(codes: torch.Tensor) -> torch.Tensor:
    """The tile layout written from its definition (cuda/gemm.cu): codes ``(K, N)`` ->
    int32 ``(N/16, K/64, 32, 4)``, word ``(t, c, 4g + tt, j)`` holding in nibble ``p``
    (``r = p & 3``, ``e = p >> 2``) the code at ``n = 16t + g + 8(r & 1)``,
    ``k = 64c + 16tt + 4j + 2(r >> 1) + e``."""
    k_, n_ = codes.shape
    t, c, g, tt, j, p = torch.meshgrid(
        *(torch.arange(v) for v in (n_ // 16, k_ // 64, 8, 4, 4, 8)), indexing="ij"
    )
    r, e = p & 3, p >> 2
    vals = codes.long()[64 * c + 16 * tt + 4 * j + 2 * (r >> 1) + e, 16 * t + g + 8 * (r & 1)]
    words = (vals << (4 * p)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(n_ // 16, k_ // 64, 32, 4).to(torch.int32)


@pytest.mark.parametrize("k,n", [(64, 16), (128, 48), (448, 96)])
def test_tile_awq_matches_its_definition(k, n, gen):
    qweight = torch.randint(-(2**31), 2**31, (k, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    codes, _ = forge.unpack_awq(qweight, torch.zeros(1, n // 8, dtype=torch.int32), k)
    tiled = forge.tile_awq(qweight)
    assert tiled.dtype == torch.int32 and tiled.shape == (n // 16, k // 64, 32, 4)
    assert torch.equal(tiled, ref_tile_awq(codes))


@pytest.mark.parametrize("k,n", [(64, 8), (64, 24), (96, 16)])
def test_tile_awq_refuses_shapes_it_cannot_tile(k, n):
    with pytest.raises(forge.errors.ShapeError):
        forge.tile_awq(torch.zeros(k, n // 8, dtype=torch.int32))
