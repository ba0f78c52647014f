"""Shared fixtures and INDEPENDENT plain-PyTorch references for the core tests.

Nothing here calls ``forge``: every helper re-implements the arithmetic of
``docs/numerics.md`` / spec gptq-core-qmeta4 from the formulas, so the tests compare the
Rust core against an independent implementation rather than against itself.

Helpers are imported by the test modules with ``from conftest import ...`` (pytest puts
``tests/`` on ``sys.path`` because it has no ``__init__.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

# Q8.8 relative bound of the qmeta4 scale: half a step of 1/256 in log2.
Q88_BOUND = 2.0 ** (1.0 / 512.0) - 1.0
EPS = 1e-9
# smallest stored scale: the smallest positive fp16 (a scale of 1e-9 would become fp16 0)
SCALE_MIN = 2.0**-24

# The references are small; torch's intra-op thread pool only adds overhead here (a 256x256
# cholesky_inverse takes 0.3 s with 2 threads vs 1 ms with 1 on the 2-core CI machine).
torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    """Items marked ``cuda`` are skipped on machines without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same global RNG state (reproducible failures)."""
    torch.manual_seed(1234)
    yield


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator for tests that want an explicit one."""
    return torch.Generator().manual_seed(20240601)


# ----------------------------------------------------------------------------- qmeta4


def ref_log2_q88(scale: torch.Tensor) -> torch.Tensor:
    """round(log2(s) * 256) computed in float64 (spec §5.2), as int64."""
    return torch.round(torch.log2(scale.double()) * 256.0).to(torch.int64)


def ref_decode_q88(q: torch.Tensor) -> torch.Tensor:
    """2 ** (q / 256) in float64, rounded once to float32."""
    return torch.exp2(q.double() / 256.0).to(torch.float32)


def qmeta_fields(qmeta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw fields of (..., 4) uint8 qmeta bytes: (log2 Q8.8 int64, zero int64, flags int64)."""
    b = qmeta.to(torch.int64)
    q = b[..., 0] | (b[..., 1] << 8)
    q = torch.where(q >= 32768, q - 65536, q)
    return q, b[..., 2], b[..., 3]


def ref_scale_of(qmeta: torch.Tensor) -> torch.Tensor:
    """Decoded float32 scale of qmeta bytes, from the raw Q8.8 field (no forge)."""
    return ref_decode_q88(qmeta_fields(qmeta)[0])


def ref_zero_of(qmeta: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero point the quantizer uses: 2**(bits-1) for symmetric groups, the stored byte else."""
    _, z, flags = qmeta_fields(qmeta)
    return torch.where((flags & 1) == 1, torch.full_like(z, 1 << (bits - 1)), z).to(torch.float32)


# ----------------------------------------------------------------------------- grids


def pad_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, cols) -> (rows, ceil(cols/G), G) float32, the last group zero padded."""
    x = x.to(torch.float32)
    rows, cols = x.shape
    pad = (-cols) % group_size
    xp = torch.nn.functional.pad(x, (0, pad))
    return xp.view(rows, (cols + pad) // group_size, group_size)


def ref_range_grid(
    x: torch.Tensor, group_size: int, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §6.2 range grid in plain float32 torch: (scale (rows, G) f32, zero (rows, G) int64)."""
    xg = pad_groups(x, group_size)
    maxq = (1 << bits) - 1
    # the grid always contains 0, as GPTQ's Quantizer.find_params
    xmin = torch.clamp(xg.amin(dim=-1), max=0.0)
    xmax = torch.clamp(xg.amax(dim=-1), min=0.0)
    if symmetric:
        amax = torch.maximum(xmin.abs(), xmax.abs())
        s = torch.clamp((2.0 * amax) / maxq + EPS, min=SCALE_MIN)
        z = torch.full(s.shape, (maxq + 1) // 2, dtype=torch.int64)
    else:
        s = torch.clamp((xmax - xmin) / maxq + EPS, min=SCALE_MIN)
        z = torch.clamp(torch.round(-xmin / s), 0, maxq).to(torch.int64)
    assert s.dtype == torch.float32
    return s, z


def ref_quant(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """q = clamp(rne(x * (1/s) + z), 0, maxq) in float32 (numerics.md quantizer)."""
    inv = 1.0 / scale
    return torch.clamp(torch.round(x * inv + zero), 0, maxq)


def ref_candidates(max_shrink: float, n: int) -> torch.Tensor:
    """Shrink factors p_i = f32(1 - s + i * 2s/(n-1)) computed in float64."""
    if n == 1:
        return torch.ones(1, dtype=torch.float32)
    i = torch.arange(n, dtype=torch.float64)
    s = float(torch.tensor(max_shrink, dtype=torch.float32))  # the core gets an f32
    return (1.0 - s + i * (2.0 * s / (n - 1))).to(torch.float32)


def ref_group_loss(
    xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, norm: float
) -> torch.Tensor:
    """sum |e|^norm per group, e = (q - z) * s - x computed in float32, summed in float64.

    xg (..., G); scale/zero broadcastable to (..., 1).
    """
    q = ref_quant(xg, scale, zero, maxq)
    e = (q - zero) * scale - xg
    return e.double().abs().pow(norm).sum(dim=-1)


def ref_rtn_codes(w: torch.Tensor, qmeta: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest codes (N, K) of weight (N, K) on its grid (plain torch)."""
    n, k = w.shape
    gi = torch.arange(k) // group_size
    s = ref_scale_of(qmeta)[:, gi]
    z = ref_zero_of(qmeta, bits)[:, gi]
    return ref_quant(w.to(torch.float32), s, z, (1 << bits) - 1)


def ref_dequant_codes(
    codes_nk: torch.Tensor, qmeta: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """(q - z) * s for codes (N, K) (float32)."""
    n, k = codes_nk.shape
    gi = torch.arange(k) // group_size
    s = ref_scale_of(qmeta)[:, gi]
    z = ref_zero_of(qmeta, bits)[:, gi]
    return (codes_nk.to(torch.float32) - z) * s


# ----------------------------------------------------------------------------- data


def correlated_inputs(t: int, k: int, gen: torch.Generator, rank: int = 6, outliers: int = 4) -> torch.Tensor:
    """Calibration-like activations X (t, k): a few dominant directions, small isotropic
    noise and a handful of large outlier channels, so H = 2 XᵀX / t is ill-conditioned."""
    basis = torch.randn(rank, k, generator=gen)
    coef = torch.randn(t, rank, generator=gen) * torch.logspace(1, -1, rank)
    x = coef @ basis + 0.05 * torch.randn(t, k, generator=gen)
    idx = torch.randperm(k, generator=gen)[:outliers]
    x[:, idx] *= 20.0
    return x


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """H = 2 XᵀX / T in float64, returned as float32."""
    xd = x.double()
    return (2.0 * xd.T @ xd / x.shape[0]).to(torch.float32)


def layer_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """‖X (W − Ŵ)ᵀ‖² in float64."""
    return float(((x.double() @ (w.double() - w_hat.double()).T) ** 2).sum())


def is_close_rel(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel)


# ---------------------------------------------------------------------------------------
# The calibrated-run tests' inputs (test_calibrate, test_prune): plain transformers models.


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny random DeepSeek-V3 (MLA, sigmoid group-limited routing, shared expert, MTP layer)."""
    from tiny_models import make_model

    return make_model("deepseek", tmp_path_factory.mktemp("ds") / "deepseek")


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    """4000 seeded random token ids (a calibration file)."""
    import json

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4000,), generator=g).tolist()
    p = tmp_path_factory.mktemp("calib") / "ids.json"
    p.write_text(json.dumps(ids))
    return p
