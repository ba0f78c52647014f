"""The Hessian API on the CPU (``forge.hessian_update``, ``forge.hessian_update_segmented``)
against float64 products written here, and its input checks. The CUDA kernels are compared
with the same references in ``test_cuda.py``."""

from __future__ import annotations

import pytest
import torch

import forge


def xtx(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x.T @ x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hessian_update_adds_alpha_xtx(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 24, generator=g).to(dtype)
    base = torch.randn(24, 24, generator=g)
    base = base + base.T
    h = base.clone()
    forge.hessian_update(h, x, 0.25)
    torch.testing.assert_close(h.double(), base.double() + 0.25 * xtx(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(h, h.T)
    # Leading dimensions are flattened into rows; no rows adds nothing.
    h3 = base.clone()
    forge.hessian_update(h3, x.reshape(1, 37, 24), 0.25)
    assert torch.equal(h3, h)
    forge.hessian_update(h3, x[:0], 1.0)
    assert torch.equal(h3, h)


def test_hessian_update_segmented_per_expert():
    g = torch.Generator().manual_seed(4)
    t, d = 50, 16
    x = torch.randn(t, d, generator=g, dtype=torch.bfloat16)
    idx = torch.randperm(t, generator=g)[:40].to(torch.int32)
    offsets = torch.tensor([0, 12, 12, 31, 40], dtype=torch.int32)  # expert 1 has no rows
    h = torch.zeros(4, d, d)
    forge.hessian_update_segmented(h, x, idx, offsets, 2.0)
    for e in range(4):
        rows = idx[offsets[e] : offsets[e + 1]].long()
        torch.testing.assert_close(h[e].double(), 2.0 * xtx(x[rows]), rtol=1e-5, atol=1e-4)
    assert not h[1].any()


def test_hessian_update_segmented_overwrite_writes_fresh_products():
    """``overwrite=True``: each expert's Hessian is ``alpha * X_e.T @ X_e`` whatever H held
    (NaN here, so nothing of it is kept), zeros for an expert without rows, and bit for bit
    what adding into zeros gives; without any routed row, all zeros."""
    g = torch.Generator().manual_seed(8)
    t, d = 50, 16
    x = torch.randn(t, d, generator=g, dtype=torch.bfloat16)
    idx = torch.randperm(t, generator=g)[:40].to(torch.int32)
    offsets = torch.tensor([0, 12, 12, 31, 40], dtype=torch.int32)
    h = torch.full((4, d, d), float("nan"))
    forge.hessian_update_segmented(h, x, idx, offsets, 0.5, overwrite=True)
    for e in range(4):
        rows = idx[offsets[e] : offsets[e + 1]].long()
        torch.testing.assert_close(h[e].double(), 0.5 * xtx(x[rows]), rtol=1e-5, atol=1e-4)
    assert not h[1].any()
    added = forge.hessian_update_segmented(torch.zeros(4, d, d), x, idx, offsets, 0.5)
    assert torch.equal(h, added)
    h = torch.full((3, d, d), float("nan"))
    forge.hessian_update_segmented(
        h, x, torch.zeros(0, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), overwrite=True
    )
    assert torch.equal(h, torch.zeros(3, d, d))


def test_hessian_update_segmented_without_routed_rows_is_a_no_op():
    h = torch.ones(3, 8, 8)
    x = torch.randn(5, 8)
    forge.hessian_update_segmented(h, x, torch.zeros(0, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    assert torch.equal(h, torch.ones(3, 8, 8))


def test_hessian_input_errors_name_the_argument():
    x = torch.randn(6, 8)
    h = torch.zeros(8, 8)
    with pytest.raises(forge.errors.InvalidValueError, match="alpha"):
        forge.hessian_update(h, x, float("nan"))
    xn = x.clone()
    xn[2, 3] = float("inf")
    with pytest.raises(forge.errors.InvalidValueError, match="x"):
        forge.hessian_update(h, xn)
    hs = torch.zeros(2, 8, 8)
    idx = torch.tensor([0, 5, 2], dtype=torch.int32)
    off = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(forge.errors.InvalidValueError, match="alpha"):
        forge.hessian_update_segmented(hs, x, idx, off, float("inf"))
    with pytest.raises(forge.errors.InvalidValueError, match="idx"):
        forge.hessian_update_segmented(hs, x, torch.tensor([0, 6, 2], dtype=torch.int32), off)
    with pytest.raises(forge.errors.InvalidValueError, match="offsets"):
        forge.hessian_update_segmented(hs, x, idx, torch.tensor([0, 2, 1], dtype=torch.int32))
    with pytest.raises(forge.errors.InvalidValueError, match="x"):
        forge.hessian_update_segmented(hs, xn, idx, off)
    assert not hs.any()
