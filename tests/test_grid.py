"""Quant grids (spec §6.2 range, §6.3 MSE / L^p search) against plain-PyTorch references."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    Q88_BOUND,
    SCALE_MIN,
    pad_groups,
    qmeta_fields,
    ref_candidates,
    ref_decode_q88,
    ref_group_loss,
    ref_log2_q88,
    ref_range_grid,
    ref_scale_of,
    ref_zero_of,
)

import forge

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _weight(rows: int, cols: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes, plus rows/groups that exercise the clamps."""
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 1, rows).unsqueeze(1)
    w[0] = 0.0  # all-zero row: scale = SCALE_MIN (EPS alone would be an fp16 scale of 0)
    w[1] = w[1].abs() + 0.1  # all positive: xmin = 0, zero point 0
    w[2] = -(w[2].abs() + 0.1)  # all negative: xmax = 0, zero point maxq
    w[3, : cols // 2] *= 30.0  # an outlier half row
    if dtype == torch.float8_e4m3fn:
        w = w.clamp(-400, 400)
    return w.to(dtype)


def _check_range(w: torch.Tensor, qmeta, maxq, pad, group_size, bits, symmetric):
    rows, cols = w.shape
    ng = -(-cols // group_size)
    assert qmeta.dtype == torch.uint8 and qmeta.shape == (rows, ng, 4)
    assert maxq == (1 << bits) - 1
    assert pad == ng * group_size - cols
    s_ref, z_ref = ref_range_grid(w.float(), group_size, bits, symmetric)
    q88, zero, flags = qmeta_fields(qmeta)
    # flags: bit0 = symmetric, nothing else
    assert torch.all(flags == int(symmetric))
    # zero point exact
    assert torch.equal(zero, z_ref)
    # scale: Q8.8 of the reference scale (float64 log2; +-1 only at exact ties) ...
    want = ref_log2_q88(s_ref)
    diff = (q88 - want).abs()
    assert diff.max() <= 1
    frac = (torch.log2(s_ref.double()) * 256.0) % 1.0
    assert torch.all((frac - 0.5).abs()[diff != 0] < 1e-4)
    # ... and the decoded scale is within the Q8.8 bound of the reference scale
    rel = (ref_scale_of(qmeta).double() / s_ref.double() - 1).abs()
    assert rel.max() <= Q88_BOUND * (1 + 1e-5)
    # bytes identical to encoding the reference (scale, zero, flag) triple
    want_bytes = forge.encode_qmeta(s_ref, z_ref.to(torch.uint8), symmetric)
    assert torch.equal(qmeta, want_bytes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("symmetric", [False, True])
def test_range_grid_matches_reference(bits, group_size, symmetric, gen):
    cols = 2 * group_size + 17  # odd length: the last group is zero padded
    w = _weight(12, cols, gen)
    qmeta, maxq, pad = forge.build_quant_grid(w, group_size, bits, symmetric, "range")
    _check_range(w, qmeta, maxq, pad, group_size, bits, symmetric)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("cols", [256, 200, 33])
def test_range_grid_dtypes(dtype, symmetric, cols, gen):
    w = _weight(10, cols, gen, dtype)
    qmeta, maxq, pad = forge.build_quant_grid(w, 64, 4, symmetric, "range")
    _check_range(w, qmeta, maxq, pad, 64, 4, symmetric)


def test_grid_contains_zero():
    # constant group: xmin = min(3, 0) = 0, xmax = 3 -> s = 3/15 + EPS, z = 0 (before: s = EPS,
    # and 3.0 dequantized to 15 * 1e-9); the padded group gets the same range
    w = torch.full((1, 40), 3.0)
    qmeta, _, pad = forge.build_quant_grid(w, 32, 4, False, "range")
    assert pad == 24
    s = ref_scale_of(qmeta)[0]
    z = qmeta_fields(qmeta)[1][0]
    assert s[0].item() == pytest.approx(0.2, rel=Q88_BOUND * 1.01)
    assert z[0].item() == 0
    # group 1: 8 threes and 24 zero pads -> s = 3/15 + EPS, z = 0
    assert s[1].item() == pytest.approx(0.2, rel=Q88_BOUND * 1.01)
    assert z[1].item() == 0


def test_mode_aliases(gen):
    w = _weight(6, 128, gen)
    a = forge.build_quant_grid(w, 32, 4, False, "range")[0]
    assert torch.equal(a, forge.build_quant_grid(w, 32, 4, False, "absmax")[0])
    assert torch.equal(a, forge.GPTQ(4, 32).build_quant_grid(w)[0])


# ----------------------------------------------------------------------------- MSE search


def _ref_mse_losses(w, base_qmeta, group_size, bits, shrink, n_grid, norm):
    """Loss of every candidate for every group: (rows, ng, P) float64, and candidate Q8.8 codes.

    Candidate i is evaluated at the scale it would be stored as:
    decode(encode(max(s0 * p_i, SCALE_MIN))) (the encoder is checked against log2 in test_qmeta).
    """
    xg = pad_groups(w.float(), group_size)  # (rows, ng, G)
    s0 = ref_scale_of(base_qmeta)  # (rows, ng)
    z = ref_zero_of(base_qmeta, bits)
    p = ref_candidates(shrink, n_grid)  # (P,)
    cand = torch.clamp(s0.unsqueeze(-1) * p, min=SCALE_MIN)  # (rows, ng, P) float32
    flat = cand.reshape(-1)
    cand_q88 = qmeta_fields(forge.encode_qmeta(flat, torch.zeros(flat.shape, dtype=torch.uint8), False))[0]
    cand_q88 = cand_q88.view(cand.shape)
    stored = ref_decode_q88(cand_q88)
    loss = ref_group_loss(xg.unsqueeze(-2), stored.unsqueeze(-1), z[..., None, None], (1 << bits) - 1, norm)
    return loss, cand_q88


def _check_mse(w, group_size, bits, symmetric, shrink, n_grid, norm, rel_tol=1e-5):
    base = forge.build_quant_grid(w, group_size, bits, symmetric, "range")[0]
    qm, maxq, pad = forge.build_quant_grid(w, group_size, bits, symmetric, "mse", shrink, n_grid, norm)
    rows, ng, _ = base.shape
    assert qm.shape == base.shape and maxq == (1 << bits) - 1
    # zero point and flags unchanged, only the scale moves
    assert torch.equal(qm[..., 2:], base[..., 2:])
    loss, cand_q88 = _ref_mse_losses(w, base, group_size, bits, shrink, n_grid, norm)
    ref_min, ref_arg = loss.min(dim=-1)
    # which candidates are forge's stored bytes?
    got_q88 = qmeta_fields(qm)[0]
    consistent = cand_q88 == got_q88.unsqueeze(-1)
    assert torch.all(consistent.any(dim=-1)), "forge's scale is not encode(s0 * p_i) for any candidate"
    chosen = torch.where(consistent, loss, torch.full_like(loss, float("inf"))).min(dim=-1).values
    # forge's choice is the argmin up to float summation order
    ok = chosen <= ref_min * (1 + rel_tol) + 1e-30
    assert torch.all(ok), (chosen[~ok], ref_min[~ok])
    exact = torch.gather(consistent, -1, ref_arg.unsqueeze(-1)).squeeze(-1)
    assert exact.float().mean() >= 0.9
    return base, qm, loss, ref_min


@pytest.mark.parametrize("norm", [2.4, 2.0])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_mse_search_is_argmin(norm, symmetric, bits, gen):
    w = _weight(16, 2 * 128 + 40, gen)
    _check_mse(w, 128, bits, symmetric, 0.2, 100, norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("group_size", [32, 256])
def test_mse_search_dtypes_and_group_sizes(dtype, group_size, gen):
    w = _weight(8, group_size * 2 - 7, gen, dtype)
    _check_mse(w, group_size, 4, False, 0.2, 100, 2.4)


@pytest.mark.parametrize("shrink, n_grid", [(0.5, 7), (0.1, 1024), (0.0, 1), (0.3, 2)])
def test_mse_search_other_grids(shrink, n_grid, gen):
    w = _weight(8, 96, gen)
    _check_mse(w, 32, 4, False, shrink, n_grid, 3.0)


def test_mse_single_candidate_keeps_range_scale(gen):
    w = _weight(8, 96, gen)
    base = forge.build_quant_grid(w, 32, 4, False, "range")[0]
    assert torch.equal(forge.build_quant_grid(w, 32, 4, False, "mse", 0.2, 1, 2.4)[0], base)


@pytest.mark.parametrize("norm", [2.4, 2.0])
@pytest.mark.parametrize("symmetric", [False, True])
def test_mse_never_worse_than_range(norm, symmetric, gen):
    w = torch.randn(48, 512, generator=gen) * torch.rand(48, 1, generator=gen) * 3
    bits, g = 4, 128
    # odd grid: p = 1.0 (the range scale) is a candidate, so the chosen candidate's loss
    # can never exceed the range loss
    base, qm, loss, ref_min = _check_mse(w, g, bits, symmetric, 0.2, 101, norm)
    p = ref_candidates(0.2, 101)
    assert p[50].item() == 1.0
    range_loss = loss[..., 50]
    assert torch.all(ref_min <= range_loss)
    xg = pad_groups(w, g)

    def stored_loss(q):
        return ref_group_loss(xg, ref_scale_of(q).unsqueeze(-1), ref_zero_of(q, bits).unsqueeze(-1), 15, norm)

    # candidates are evaluated at their stored (Q8.8) scale, so with 101 points the stored
    # loss never exceeds the range loss (up to float summation order); with the default grid
    # (100 points, 1.0 not a candidate) at most a Q8.8 step worse per group
    qd = forge.build_quant_grid(w, g, bits, symmetric, "mse", 0.2, 100, norm)[0]
    lr, ld, l101 = stored_loss(base), stored_loss(qd), stored_loss(qm)
    assert torch.all(ld <= lr * (1 + 2e-3))
    assert torch.all(l101 <= lr * (1 + 1e-5))
    assert ld.sum() < 0.95 * lr.sum()
    assert l101.sum() < 0.95 * lr.sum()


def test_mse_defaults(gen):
    w = _weight(8, 256, gen)
    a = forge.build_quant_grid(w, 128, 4, False, "mse")[0]
    b = forge.build_quant_grid(w, 128, 4, False, "mse", 0.2, 100, 2.4)[0]
    assert torch.equal(a, b)
    c = forge.GPTQ(4, 128).build_quant_grid(w, mode="mse")[0]
    assert torch.equal(a, c)
    # the defaults really are (0.2, 100, 2.4): a different norm or grid changes some group
    d = forge.build_quant_grid(w, 128, 4, False, "mse", 0.2, 100, 2.0)[0]
    e = forge.build_quant_grid(w, 128, 4, False, "mse", 0.3, 100, 2.4)[0]
    assert not torch.equal(a, d) or not torch.equal(a, e)
    import inspect

    sig = inspect.signature(forge.build_quant_grid).parameters
    assert (sig["quant_max_shrink"].default, sig["quant_n_grid"].default, sig["quant_norm"].default) == (
        0.2,
        100,
        2.4,
    )


def test_quantize_rtn_matches_reference(gen):
    from conftest import ref_rtn_codes

    for dtype in DTYPES:
        for bits, sym in [(4, False), (4, True), (3, False), (8, True)]:
            w = _weight(8, 100, gen, dtype)
            qmeta = forge.build_quant_grid(w, 32, bits, sym, "mse")[0]
            codes = forge.quantize_rtn(w, qmeta, bits, 32)
            assert codes.dtype == torch.uint8 and codes.shape == (100, 8)
            want = ref_rtn_codes(w.float(), qmeta, bits, 32)
            assert torch.equal(codes.T.to(torch.float32), want), (dtype, bits, sym)


# ----------------------------------------------------------------------------- trust


def _gptq_find_params(x: torch.Tensor, maxq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ reference ``Quantizer.find_params`` (asymmetric, per row): the range includes 0."""
    xmin = torch.minimum(x.min(1)[0], torch.zeros(x.shape[0]))
    xmax = torch.maximum(x.max(1)[0], torch.zeros(x.shape[0]))
    both0 = (xmin == 0) & (xmax == 0)
    xmin[both0], xmax[both0] = -1.0, 1.0
    scale = (xmax - xmin) / maxq
    zero = torch.round(-xmin / scale)
    return scale, zero


@pytest.mark.parametrize("mode", ["range", "mse"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_signed_groups_dequantize_like_gptq(mode, sign, gen):
    # every group one-signed: [0.4, 0.6], [3, 5], a constant; forge's dequantized group must be
    # as close as the GPTQ reference grid (before: zero point clamped, ~60 % error)
    rows, g = 6, 64
    base = torch.rand(rows, g, generator=gen)
    w = (
        torch.stack(
            [
                0.4 + 0.2 * base[0],
                3 + 2 * base[1],
                torch.full((g,), 0.7),
                1e-3 + base[3] * 1e-3,
                0.4 + 0.2 * base[4],
                0.05 + base[5],
            ]
        )
        * sign
    )
    qmeta, maxq, _ = forge.build_quant_grid(w, g, 4, False, mode)
    s = ref_scale_of(qmeta)[:, 0:1]
    z = ref_zero_of(qmeta, 4)[:, 0:1]
    deq = (torch.clamp(torch.round(w / s + z), 0, maxq) - z) * s
    rs, rz = _gptq_find_params(w, maxq)
    ref = (torch.clamp(torch.round(w / rs[:, None] + rz[:, None]), 0, maxq) - rz[:, None]) * rs[:, None]
    err = (deq - w).abs().amax(dim=1)
    ref_err = (ref - w).abs().amax(dim=1)
    # at most half a step of the reference grid (plus the Q8.8 scale rounding over 15 steps)
    assert torch.all(err <= 0.5 * rs * 1.001 + maxq * rs * Q88_BOUND), (err, ref_err)
    rel = err / w.abs().amax(dim=1)
    assert torch.all(rel < 0.06), rel


@pytest.mark.parametrize("mode", ["range", "mse"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_zero_and_tiny_groups_get_a_positive_fp16_scale(mode, symmetric):
    w = torch.zeros(8, 128)
    w[1] = 1e-9
    w[2, :5] = -3e-8
    w[3] = 1e-30
    w[4:] = torch.randn(4, 128)
    qmeta = forge.build_quant_grid(w, 64, 4, symmetric, mode)[0]
    s = ref_scale_of(qmeta)
    assert torch.all(s >= SCALE_MIN), s
    assert torch.all(s.to(torch.float16) > 0), s
    # through the AWQ packer: fp16 scales positive, the all-zero row dequantizes to exactly 0,
    # the tiny rows to within half a step of 2^-24
    codes = forge.quantize_rtn(w, qmeta, 4, 64)
    qweight, qzeros, scales = forge.pack_awq(codes, qmeta, 64)
    assert torch.all(scales > 0)
    deq = forge.dequantize_awq(qweight, qzeros, scales, 64)
    assert torch.equal(deq[0], torch.zeros(128))
    assert (deq[:4] - w[:4]).abs().max() <= SCALE_MIN
