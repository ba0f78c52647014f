"""GPTQ: Hessian preparation and the blocked solver against a plain-PyTorch port of
Algorithm 1 (GPTQ authors' ``fasterquant`` structure) written here, plus layer error vs RTN."""

from __future__ import annotations

import pytest
import torch
from conftest import correlated_inputs, hessian_of, layer_error, ref_dequant_codes, ref_rtn_codes

import forge
from forge.errors import HessianError, InvalidValueError

# ----------------------------------------------------------------------------- reference


def ref_prepare(h: torch.Tensor, percdamp: float, act_order: bool):
    """Dead inputs, activation order, damping, U = chol(H^-1) upper, all in float64.

    Returns (H_damped (processing order), U, perm or None, dead mask, damp).
    """
    h = h.double().clone()
    diag0 = torch.diag(h).clone()
    dead = diag0 == 0
    h[dead, dead] = 1.0
    perm = None
    if act_order:
        # descending ORIGINAL diagonal (dead inputs last), stable
        perm = torch.argsort(diag0, descending=True, stable=True)
        h = h[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(h))
    idx = torch.arange(h.shape[0])
    h[idx, idx] += damp
    lower = torch.linalg.cholesky(h)
    hinv = torch.cholesky_inverse(lower)
    u = torch.linalg.cholesky(hinv, upper=True)
    return h, u, perm, dead, float(damp)


def ref_gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    qmeta: torch.Tensor,
    bits: int,
    group_size: int,
    blocksize: int,
    percdamp: float = 0.01,
    act_order: bool = False,
    dtype=torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 of Frantar et al. as in the authors' ``GPTQ.fasterquant``.

    ``w`` (N, K) PyTorch layout. The quantizer uses the SAME qmeta decoded with
    ``forge.decode_qmeta`` (symmetric zero = 2^(bits-1)); static groups: the group of a
    column is that of its ORIGINAL index. Returns (codes (N, K), dequantized (N, K)).
    """
    n, k = w.shape
    maxq = (1 << bits) - 1
    scale, zero, sym = forge.decode_qmeta(qmeta)
    scale = scale.to(dtype)
    zero = torch.where(sym, torch.full_like(zero, 1 << (bits - 1)), zero).to(dtype)
    W = w.to(dtype).clone()
    _, hinv, perm, dead, _ = ref_prepare(h, percdamp, act_order)
    hinv = hinv.to(dtype)
    W[:, dead] = 0
    if perm is not None:
        W = W[:, perm]
    Q = torch.zeros_like(W)
    codes = torch.zeros_like(W)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        C1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = hinv[i1:i2, i1:i2]
        for i in range(count):
            w_col = W1[:, i]
            d = Hinv1[i, i]
            col = int(perm[i1 + i]) if perm is not None else i1 + i
            g = col // group_size
            s, z = scale[:, g], zero[:, g]
            q = torch.clamp(torch.round(w_col / s + z), 0, maxq)
            qd = (q - z) * s
            C1[:, i] = q
            Q1[:, i] = qd
            err1 = (w_col - qd) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        codes[:, i1:i2] = C1
        W[:, i2:] -= Err1.matmul(hinv[i1:i2, i2:])
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        codes = codes[:, inv]
    return codes, Q


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def layer():
    """W (256, 512) and ill-conditioned H = 2 XᵀX / T from correlated inputs."""
    gen = torch.Generator().manual_seed(7)
    n, k, t = 256, 512, 1024
    x = correlated_inputs(t, k, gen)
    w = torch.randn(n, k, generator=gen)
    return x, w, hessian_of(x)


@pytest.fixture(scope="module")
def big_layer():
    gen = torch.Generator().manual_seed(11)
    n, k, t = 256, 512, 1024
    x = correlated_inputs(t, k, gen, rank=8, outliers=6)
    w = torch.randn(n, k, generator=gen) * 0.5
    return x, w, hessian_of(x)


def _forge_gptq(w, h, qmeta, bits, g, block, act_order, percdamp=0.01):
    f = forge.prepare_hessian(h, percdamp, act_order)
    codes, deq_t = forge.gptq_solve(w.t().contiguous(), f.hinv_chol, qmeta, bits, g, block, f.perm)
    return codes, deq_t, f


# ----------------------------------------------------------------------------- Hessian


def test_hessian_is_ill_conditioned(layer):
    _, _, h = layer
    ev = torch.linalg.eigvalsh(h.double())
    assert ev.max() / ev.clamp(min=1e-30).min() > 1e4


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("percdamp", [0.01, 0.1])
def test_prepare_hessian_factor(layer, act_order, percdamp):
    _, _, h = layer
    f = forge.prepare_hessian(h, percdamp, act_order)
    c = h.shape[0]
    hd, u_ref, perm, dead, damp = ref_prepare(h, percdamp, act_order)
    assert f.retries == 0 and f.dead == 0
    assert f.damp == pytest.approx(damp, rel=1e-5)
    u = f.hinv_chol
    assert u.dtype == torch.float32 and u.shape == (c, c)
    assert torch.equal(u, torch.triu(u)) and torch.all(torch.diag(u) > 0)
    if act_order:
        assert f.perm.dtype == torch.int64 and torch.equal(f.perm, perm)
    else:
        assert f.perm is None
    # Uᵀ U ≈ (H + damp I)^-1 (in processing order)
    hinv = torch.linalg.inv(hd)
    utu = u.double().T @ u.double()
    assert torch.linalg.norm(utu - hinv) / torch.linalg.norm(hinv) < 1e-3
    assert torch.linalg.norm(u.double() - u_ref) / torch.linalg.norm(u_ref) < 1e-3


@pytest.mark.parametrize("act_order", [False, True])
def test_prepare_hessian_large_blocked_inverse(act_order):
    """C = 1100 = 275 · 2²: the level-by-level triangular inverse (275-wide leaves joined twice),
    the reversal and the batch loop against the float64 three-factorisation reference."""
    gen = torch.Generator().manual_seed(3)
    k = 1100
    x = correlated_inputs(2048, k, gen)
    h = hessian_of(x)
    h[5, :] = 0
    h[:, 5] = 0
    u, perm, damp, retries, dead = forge.prepare_hessian_batched(torch.stack([h, 2 * h]), 0.01, act_order)
    for i, scale in enumerate((1.0, 2.0)):
        hd, u_ref, perm_ref, _, damp_ref = ref_prepare(scale * h, 0.01, act_order)
        assert dead[i] == 1 and retries[i] == 0
        assert damp[i] == pytest.approx(damp_ref, rel=1e-5)
        assert torch.equal(u[i], torch.triu(u[i])) and torch.all(torch.diag(u[i]) > 0)
        assert torch.linalg.norm(u[i].double() - u_ref) / torch.linalg.norm(u_ref) < 1e-3
        if act_order:
            assert torch.equal(perm[i], perm_ref)
        else:
            assert perm is None


def test_prepare_hessian_dead_inputs(layer):
    _, _, h = layer
    h = h.clone()
    dead = [3, 100, 255]
    h[dead, :] = 0
    h[:, dead] = 0
    f = forge.prepare_hessian(h, 0.01, True)
    assert f.dead == 3
    # dead inputs (zero diagonal) sort last, in index order
    assert f.perm[-3:].tolist() == dead
    hd, _, perm, _, damp = ref_prepare(h, 0.01, True)
    assert torch.equal(f.perm, perm)
    assert f.damp == pytest.approx(damp, rel=1e-5)
    utu = f.hinv_chol.double().T @ f.hinv_chol.double()
    hinv = torch.linalg.inv(hd)
    assert torch.linalg.norm(utu - hinv) / torch.linalg.norm(hinv) < 1e-3


def test_prepare_hessian_retries_on_indefinite():
    h = torch.tensor([[1.0, 3.0], [3.0, 1.0]])  # eigenvalues 4, -2
    f = forge.prepare_hessian(h, 0.01, False)
    assert f.retries > 0
    # damping = percdamp * mean(diag) * 10^retries, and it made H + damp I positive definite
    assert f.damp == pytest.approx(0.01 * 10**f.retries, rel=1e-5)
    assert f.damp > 2.0
    hd = h.double() + f.damp * torch.eye(2, dtype=torch.float64)
    utu = f.hinv_chol.double().T @ f.hinv_chol.double()
    assert torch.allclose(utu, torch.linalg.inv(hd), rtol=1e-5, atol=1e-6)


def test_prepare_hessian_gives_up():
    h = torch.tensor([[1.0, 1e9], [1e9, 1.0]])
    with pytest.raises(HessianError, match="hessian"):
        forge.prepare_hessian(h, 0.01, False)


def test_prepare_hessian_negative_diagonal():
    with pytest.raises(InvalidValueError, match="hessian"):
        forge.prepare_hessian(torch.tensor([[1.0, 0.0], [0.0, -1.0]]), 0.01, False)


# ----------------------------------------------------------------------------- solver


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("block", [32, 128])
def test_solver_matches_algorithm1(layer, block, group_size, symmetric, act_order):
    x, w, h = layer
    bits = 4
    qmeta = forge.build_quant_grid(w, group_size, bits, symmetric, "mse")[0]
    codes, deq_t, _ = _forge_gptq(w, h, qmeta, bits, group_size, block, act_order)
    rcodes, rdeq = ref_gptq(w, h, qmeta, bits, group_size, block, act_order=act_order)
    codes_nk = codes.T.double()
    equal = codes_nk == rcodes
    assert equal.float().mean() >= 0.995, equal.float().mean()
    # a disagreement is (almost always) a neighbouring code: a value within float noise of a
    # rounding boundary; its changed error can, rarely, push a later column of the same row
    # one code further
    delta = (codes_nk - rcodes).abs()
    assert delta.max() <= 2 and (delta >= 2).float().mean() <= 1e-4
    # where the codes agree, the dequantized weights agree to float precision
    s = forge.decode_qmeta(qmeta)[0][:, torch.arange(w.shape[1]) // group_size].double()
    diff = (deq_t.T.double() - rdeq).abs()
    assert torch.all(diff[equal] <= 1e-6 * s[equal])
    # and the layer errors agree
    e_forge, e_ref = layer_error(x, w, deq_t.T), layer_error(x, w, rdeq)
    assert e_forge == pytest.approx(e_ref, rel=2e-2)


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
def test_solver_odd_shapes(act_order):
    # N = 300 spans two column tiles of the solver (one partial), K = 200 leaves a partial
    # last group (G = 64) and a partial last block (B = 48)
    gen = torch.Generator().manual_seed(5)
    n, k = 300, 200
    x = correlated_inputs(400, k, gen)
    w = torch.randn(n, k, generator=gen)
    h = hessian_of(x)
    qmeta, _, pad = forge.build_quant_grid(w, 64, 4, False, "mse")
    assert pad == 56
    codes, deq_t, _ = _forge_gptq(w, h, qmeta, 4, 64, 48, act_order)
    rcodes, rdeq = ref_gptq(w, h, qmeta, 4, 64, 48, act_order=act_order)
    assert (codes.T.double() == rcodes).float().mean() >= 0.995
    assert layer_error(x, w, deq_t.T) == pytest.approx(layer_error(x, w, rdeq), rel=2e-2)


def test_solver_matches_algorithm1_float32_reference(layer):
    x, w, h = layer
    qmeta = forge.build_quant_grid(w, 64, 3, False, "range")[0]
    codes, _, _ = _forge_gptq(w, h, qmeta, 3, 64, 64, False)
    rcodes, _ = ref_gptq(w, h, qmeta, 3, 64, 64, dtype=torch.float32)
    assert (codes.T.double() == rcodes.double()).float().mean() >= 0.995


def test_solver_dequantized_is_dequant_of_codes(layer):
    _, w, h = layer
    for sym, bits, g, act in [
        (False, 4, 32, False),
        (True, 4, 128, True),
        (False, 3, 64, True),
        (True, 8, 32, False),
    ]:
        qmeta = forge.build_quant_grid(w, g, bits, sym, "mse")[0]
        codes, deq_t, _ = _forge_gptq(w, h, qmeta, bits, g, 64, act)
        assert codes.dtype == torch.uint8 and codes.shape == (w.shape[1], w.shape[0])
        assert deq_t.dtype == torch.float32 and deq_t.shape == codes.shape
        assert codes.max() <= (1 << bits) - 1
        assert torch.equal(deq_t.T, ref_dequant_codes(codes.T, qmeta, bits, g))


def test_solver_with_identity_hessian_is_rtn(layer):
    # H = I: no error is propagated, GPTQ degenerates to round-to-nearest
    _, w, _ = layer
    k = w.shape[1]
    qmeta = forge.build_quant_grid(w, 32, 4, False, "mse")[0]
    codes, _, _ = _forge_gptq(w, torch.eye(k), qmeta, 4, 32, 32, False)
    assert torch.equal(codes.T.float(), ref_rtn_codes(w, qmeta, 4, 32))


def test_solver_dead_inputs(layer):
    x, w, h = layer
    x = x.clone()
    dead = [5, 77, 200]
    x[:, dead] = 0
    h = hessian_of(x)
    qmeta = forge.build_quant_grid(w, 32, 4, False, "mse")[0]
    for act_order in (False, True):
        codes, deq_t, f = _forge_gptq(w, h, qmeta, 4, 32, 64, act_order)
        assert f.dead == 3
        assert torch.isfinite(deq_t).all()
        rcodes, rdeq = ref_gptq(w, h, qmeta, 4, 32, 64, act_order=act_order)
        live = torch.ones(w.shape[1], dtype=torch.bool)
        live[dead] = False
        # the reference zeroes dead columns of W (fasterquant); forge keeps them. Dead inputs
        # are decoupled in H, so the live columns are unaffected either way ...
        assert (codes.T.double()[:, live] == rcodes[:, live]).float().mean() >= 0.995
        # ... and no error reaches the dead columns: they are plain RTN of W
        assert torch.equal(codes.T.float()[:, dead], ref_rtn_codes(w, qmeta, 4, 32)[:, dead])
        assert layer_error(x, w, deq_t.T) == pytest.approx(layer_error(x, w, rdeq), rel=2e-2)


@pytest.mark.parametrize("mode", ["range", "mse"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn(big_layer, mode, act_order):
    x, w, h = big_layer
    g, bits = 128, 4
    qmeta = forge.build_quant_grid(w, g, bits, False, mode)[0]
    rtn = ref_dequant_codes(ref_rtn_codes(w, qmeta, bits, g), qmeta, bits, g)
    _, deq_t, _ = _forge_gptq(w, h, qmeta, bits, g, 128, act_order)
    e_rtn, e_gptq = layer_error(x, w, rtn), layer_error(x, w, deq_t.T)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    # and the packed AWQ result is the solver's dequantization up to the fp16 scales
    f = forge.prepare_hessian(h, 0.01, act_order)
    codes = forge.gptq_solve(w.t().contiguous(), f.hinv_chol, qmeta, bits, g, 128, f.perm)[0]
    deq16 = forge.dequantize_awq(*forge.pack_awq(codes, qmeta, g), g)
    assert torch.allclose(deq16, deq_t.T, rtol=2**-10, atol=0)


def test_gptq_quantize_and_class_wrappers(layer):
    x, w, h = layer
    r = forge.gptq_quantize(
        w, h, bits=4, group_size=64, symmetric=True, mode="mse", act_order=True, block_size=32
    )
    assert r.codes.shape == (w.shape[1], w.shape[0]) and r.dequantized.shape == w.shape
    qmeta = forge.build_quant_grid(w, 64, 4, True, "mse")[0]
    assert torch.equal(r.qmeta, qmeta)
    f = forge.prepare_hessian(h, 0.01, True)
    codes, deq_t = forge.gptq_solve(w.t().contiguous(), f.hinv_chol, qmeta, 4, 64, 32, f.perm)
    assert torch.equal(r.codes, codes) and torch.equal(r.dequantized, deq_t.T)
    g = forge.GPTQ(bits=4, group_size=64, symmetric=True, block_size=32)
    qm2, maxq, pad = g.build_quant_grid(w, mode="mse")
    assert torch.equal(qm2, qmeta) and int(maxq) == 15 and pad == 0
    assert torch.equal(g.solver(w.t().contiguous(), f.hinv_chol, qm2, maxq, perm=f.perm), codes)
