"""qmeta4: byte layout, encode/decode against float64 log2/exp2, fields and bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import Q88_BOUND, qmeta_fields, ref_decode_q88, ref_log2_q88

import forge
from forge.errors import DTypeError, InvalidValueError, ShapeError


def _enc(scale, zero=0, symmetric=False):
    scale = torch.as_tensor(scale, dtype=torch.float32)
    zero = torch.full(scale.shape, zero, dtype=torch.uint8) if isinstance(zero, int) else zero
    return forge.encode_qmeta(scale, zero, symmetric)


def test_worked_example_bytes_and_uint32():
    q = _enc([0.01], 8, True)
    assert q.dtype == torch.uint8 and q.shape == (1, 4)
    assert q[0].tolist() == [0x5B, 0xF9, 0x08, 0x01]
    assert q.view(torch.int32).item() == 0x0108F95B
    s, z, sym = forge.decode_qmeta(q)
    assert s.dtype == torch.float32 and z.dtype == torch.uint8 and sym.dtype == torch.bool
    assert s.item() == pytest.approx(0.0099953, rel=1e-5)
    assert s.item() == ref_decode_q88(torch.tensor(-1701)).item()
    assert z.item() == 8 and sym.item() is True
    rel = abs(s.item() - 0.01) / 0.01
    assert rel == pytest.approx(4.7e-4, abs=1e-5)
    assert rel <= Q88_BOUND


def test_uint32_view_bit_fields(gen):
    scale = torch.exp(torch.empty(257).uniform_(-40, 40, generator=gen)).float()
    zero = torch.randint(0, 256, (257,), dtype=torch.uint8, generator=gen)
    sym = torch.rand(257, generator=gen) < 0.5
    q = forge.encode_qmeta(scale, zero, sym)
    u = q.view(torch.int32).squeeze(-1).to(torch.int64) & 0xFFFFFFFF
    log2q, z, flags = qmeta_fields(q)
    low = u & 0xFFFF
    assert torch.equal(torch.where(low >= 32768, low - 65536, low), log2q)
    assert torch.equal((u >> 16) & 0xFF, zero.to(torch.int64))
    assert torch.equal(u >> 24, sym.to(torch.int64))  # bit0 = symmetric, reserved bits 0
    assert torch.equal(z, zero.to(torch.int64))
    assert torch.equal(flags, sym.to(torch.int64))


def test_decode_returns_fields(gen):
    zero = torch.randint(0, 256, (3, 5), dtype=torch.uint8, generator=gen)
    sym = torch.rand(3, 5, generator=gen) < 0.5
    q = forge.encode_qmeta(torch.full((3, 5), 0.5), zero, sym)
    assert q.shape == (3, 5, 4)
    s, z, f = forge.decode_qmeta(q)
    assert s.shape == z.shape == f.shape == (3, 5)
    assert torch.equal(z, zero) and torch.equal(f, sym)
    assert torch.all(s == 0.5)  # exact power of two
    # bool symmetric flag broadcast by the wrapper
    q2 = _enc(torch.full((2, 2), 1.0), 3, True)
    assert torch.all(q2[..., 3] == 1) and torch.all(q2[..., 2] == 3)


def test_roundtrip_relative_error_all_magnitudes(gen):
    # log-uniform over 1e-30 .. 1e30 plus the decade points themselves
    e = torch.empty(20000, dtype=torch.float64).uniform_(-30, 30, generator=gen)
    s = torch.cat([torch.pow(10.0, e), torch.pow(10.0, torch.arange(-30, 31, dtype=torch.float64))])
    s = s.float()
    d = forge.decode_qmeta(_enc(s))[0]
    rel = ((d.double() - s.double()).abs() / s.double()).max().item()
    assert rel <= Q88_BOUND * (1 + 1e-5), rel


def test_encode_matches_float64_log2_rounding(gen):
    e = torch.empty(50000, dtype=torch.float64).uniform_(-30, 30, generator=gen)
    s = torch.pow(10.0, e).float()
    got = qmeta_fields(_enc(s))[0]
    want = ref_log2_q88(s)
    diff = (got - want).abs()
    assert diff.max().item() <= 1
    # a difference is only allowed at (float32-noise) ties of round(log2(s) * 256)
    frac = (torch.log2(s.double()) * 256.0) % 1.0
    at_tie = (frac - 0.5).abs() < 1e-4
    assert torch.all(at_tie[diff != 0])


def test_exact_powers_of_two_and_subnormal_path():
    e = torch.arange(-126, 128)
    s = torch.pow(2.0, e.double()).float()
    q = qmeta_fields(_enc(s))[0]
    assert torch.equal(q, 256 * e)
    assert torch.equal(forge.decode_qmeta(_enc(s))[0], s)
    # a subnormal scale is normalised exactly: 2^-127 -> q = -127*256
    sub = torch.tensor([2.0**-127, 2.0**-127 * 1.5], dtype=torch.float32)
    q = qmeta_fields(_enc(sub))[0]
    assert torch.equal(q, ref_log2_q88(sub))


def test_decode_equals_exp2_for_every_code():
    q = torch.arange(-32768, 32768, dtype=torch.int64)
    u = q & 0xFFFF
    b = torch.stack([u & 0xFF, u >> 8, torch.zeros_like(u), torch.zeros_like(u)], -1).to(torch.uint8)
    s = forge.decode_qmeta(b)[0]
    want = ref_decode_q88(q)
    normal = q >= -126 * 256
    assert torch.equal(s[normal], want[normal])  # f32(2^(k/256)) * 2^e is exact
    # subnormal results: within one subnormal ulp of the float64 value
    assert (s[~normal].double() - torch.exp2(q[~normal].double() / 256)).abs().max() <= 2.0**-149
    # encode(decode(q)) == q for every normal code
    back = qmeta_fields(_enc(s[normal]))[0]
    assert torch.equal(back, q[normal])


def test_encode_saturates_int16():
    # log2(1e-44) * 256 = -37395 is below the int16 range; the largest f32 still fits
    q = qmeta_fields(_enc([1e-44, 3.0e38]))[0]
    assert q[0].item() == -32768
    assert q[1].item() == ref_log2_q88(torch.tensor([3.0e38])).item() == 32721


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_encode_rejects_non_positive_or_non_finite_scale(bad):
    with pytest.raises(InvalidValueError, match="scale"):
        _enc([1.0, bad, 2.0])


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(scale=torch.ones(3, dtype=torch.float64)), DTypeError, "scale"),
        (dict(scale=torch.ones(3, dtype=torch.float16)), DTypeError, "scale"),
        (dict(zero=torch.zeros(3, dtype=torch.int64)), DTypeError, "zero"),
        (dict(zero=torch.zeros(3, dtype=torch.int32)), DTypeError, "zero"),
        (dict(symmetric=torch.zeros(3, dtype=torch.uint8)), DTypeError, "symmetric"),
        (dict(zero=torch.zeros(4, dtype=torch.uint8)), ShapeError, "zero"),
        (dict(symmetric=torch.zeros(2, dtype=torch.bool)), ShapeError, "symmetric"),
        (dict(scale=[0.1, 0.2, 0.3]), TypeError, "scale"),
    ],
)
def test_encode_bad_inputs(kwargs, exc, name):
    args = dict(
        scale=torch.ones(3),
        zero=torch.zeros(3, dtype=torch.uint8),
        symmetric=torch.zeros(3, dtype=torch.bool),
    )
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        forge.encode_qmeta(args["scale"], args["zero"], args["symmetric"])


def test_encode_non_tensor_scale_with_bool_flag():
    with pytest.raises(DTypeError, match="scale"):
        forge.encode_qmeta([0.1], torch.zeros(1, dtype=torch.uint8), True)


@pytest.mark.parametrize(
    "qmeta, exc",
    [
        (torch.zeros(3, 3, dtype=torch.uint8), ShapeError),
        (torch.zeros(5, dtype=torch.uint8), ShapeError),
        (torch.zeros(3, 4, dtype=torch.int8), DTypeError),
        (torch.zeros(3, 4, dtype=torch.int32), DTypeError),
        ([[0, 0, 0, 0]], DTypeError),
    ],
)
def test_decode_bad_inputs(qmeta, exc):
    with pytest.raises(exc, match="qmeta"):
        forge.decode_qmeta(qmeta)
