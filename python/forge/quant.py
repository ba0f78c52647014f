"""The functional API: quantization grids (qmeta4), GPTQ, packing and W4A16 matmul.

All functions take and return ``torch.Tensor`` and run in Rust (``forge._native``) without
the GIL. Shapes follow one convention everywhere:

* ``W`` is a PyTorch linear weight ``(N, K)`` = (out_features, in_features).
* A grid (``qmeta``) is built over the rows of a 2-D tensor in groups of ``group_size``
  consecutive elements: for ``W`` it is ``(N, ceil(K / group_size), 4)`` uint8 — 4 bytes
  per group (int16 log2(scale) in Q8.8, uint8 zero point, uint8 flags; see
  ``docs/numerics.md``). ``qmeta.view(torch.int32)`` gives the little-endian uint32 view.
* Codes (integer quantized values) are ``(K, N)`` uint8: the transposed ``(C, R)``
  convention of the GPTQ solver and the row order of vLLM's AWQ ``qweight``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _native

__all__ = [
    "build_quant_grid",
    "quantize_rtn",
    "encode_qmeta",
    "decode_qmeta",
    "HessianFactor",
    "prepare_hessian",
    "gptq_solve",
    "GPTQResult",
    "gptq_quantize",
    "pack_awq",
    "quantize_pack_awq",
    "unpack_awq",
    "dequantize_awq",
    "awq_matmul",
    "pack_gptq",
    "unpack_gptq",
    "dequantize_gptq",
]


def build_quant_grid(
    weight: torch.Tensor,
    group_size: int = 128,
    bits: int = 4,
    symmetric: bool = False,
    mode: str = "range",
    quant_max_shrink: float = 0.2,
    quant_n_grid: int = 100,
    quant_norm: float = 2.4,
) -> tuple[torch.Tensor, int, int]:
    """Group metadata of a ``(rows, cols)`` weight (fp32, fp16, bf16 or float8_e4m3fn).

    ``mode="range"`` (alias ``"absmax"``) uses each group's min/max (absmax when
    symmetric); ``mode="mse"`` then searches ``quant_n_grid`` shrink factors in
    ``[1 - quant_max_shrink, 1 + quant_max_shrink]`` for the smallest ``sum |e|^quant_norm``.
    Rows of any length are padded with zeros to a multiple of ``group_size``.

    Returns ``(qmeta (rows, ceil(cols/group_size), 4) uint8, maxq = 2**bits - 1, pad)``.
    """
    return _native.build_quant_grid(
        weight, group_size, bits, symmetric, mode, quant_max_shrink, quant_n_grid, quant_norm
    )


def quantize_rtn(weight: torch.Tensor, qmeta: torch.Tensor, bits: int = 4, group_size: int = 128) -> torch.Tensor:
    """Round-to-nearest codes of ``weight (N, K)`` on its grid, as ``(K, N)`` uint8."""
    return _native.quantize_rtn(weight, qmeta, bits, group_size)


def encode_qmeta(scale: torch.Tensor, zero: torch.Tensor, symmetric: torch.Tensor | bool) -> torch.Tensor:
    """Encodes float32 scales, uint8 zero points and symmetric flags into ``(..., 4)`` uint8."""
    if isinstance(symmetric, bool) and isinstance(scale, torch.Tensor):
        symmetric = torch.full(scale.shape, symmetric, dtype=torch.bool)
    return _native.encode_qmeta(scale, zero, symmetric)


def decode_qmeta(qmeta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decodes ``(..., 4)`` uint8 into ``(scale float32, zero uint8, symmetric bool)``."""
    return _native.decode_qmeta(qmeta)


class HessianFactor(NamedTuple):
    """A Hessian prepared for GPTQ (see :func:`prepare_hessian`)."""

    hinv_chol: torch.Tensor
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``), ``(C, C)`` float32, in
    processing order."""
    perm: torch.Tensor | None
    """Processing order (int64, activation order) or ``None``."""
    damp: float
    """Absolute damping added to the diagonal."""
    retries: int
    """How often the damping was multiplied by 10 before the factorisation succeeded."""
    dead: int
    """Inputs with a zero Hessian diagonal (never active in calibration)."""


def prepare_hessian(hessian: torch.Tensor, percdamp: float = 0.01, act_order: bool = False) -> HessianFactor:
    """Prepares ``H (C, C)`` float32 (``H ∝ X^T X``) for :func:`gptq_solve`.

    Dead inputs get a unit diagonal, ``percdamp * mean(diag(H))`` is added to the diagonal,
    and ``U = chol(H^-1)`` (upper) is computed with faer. When a factorisation fails the
    damping is multiplied by 10 (up to 6 times); ``retries`` reports it. With ``act_order``
    inputs are processed by descending ``diag(H)`` (static groups keep the layout
    g_idx-free).
    """
    return HessianFactor(*_native.prepare_hessian(hessian, float(percdamp), bool(act_order)))


def gptq_solve(
    weight_t: torch.Tensor,
    hinv_chol: torch.Tensor,
    qmeta: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    block_size: int = 128,
    perm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (Algorithm 1 of Frantar et al., blocked) on the transposed weight.

    ``weight_t`` is ``W.T``, shape ``(C, R) = (K, N)``; ``hinv_chol`` and ``perm`` come from
    :func:`prepare_hessian`; ``qmeta`` is the grid of ``W`` (``(R, ceil(C/group_size), 4)``).
    Returns ``(codes (C, R) uint8, dequantized (C, R) float32)`` in the original order.
    """
    return _native.gptq_solve(weight_t, hinv_chol, qmeta, bits, group_size, block_size, perm)


class GPTQResult(NamedTuple):
    """Output of :func:`gptq_quantize`."""

    codes: torch.Tensor
    """``(K, N)`` uint8 codes."""
    qmeta: torch.Tensor
    """``(N, K/G, 4)`` grid."""
    dequantized: torch.Tensor
    """``(N, K)`` float32 dequantized weight."""
    factor: HessianFactor
    """The prepared Hessian (damping, retries, dead inputs)."""


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    mode: str = "mse",
    act_order: bool = False,
    percdamp: float = 0.01,
    block_size: int = 128,
    **grid_kwargs: float,
) -> GPTQResult:
    """Grid + Hessian preparation + solve for one linear ``weight (N, K)`` with ``H (K, K)``."""
    qmeta, _, _ = build_quant_grid(weight, group_size, bits, symmetric, mode, **grid_kwargs)
    k = weight.shape[1]
    if isinstance(hessian, torch.Tensor) and tuple(hessian.shape) != (k, k):
        from .errors import ShapeError

        raise ShapeError(f"hessian: expected ({k}, {k}) for weight {tuple(weight.shape)}, got {tuple(hessian.shape)}")
    factor = prepare_hessian(hessian, percdamp, act_order)
    codes, deq_t = gptq_solve(
        weight.t().contiguous(), factor.hinv_chol, qmeta, bits, group_size, block_size, factor.perm
    )
    return GPTQResult(codes, qmeta, deq_t.t().contiguous(), factor)


def pack_awq(
    codes: torch.Tensor, qmeta: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packs 4-bit ``codes (K, N)`` and their grid ``(N, K/G, 4)`` into vLLM's AWQ layout.

    Returns ``(qweight int32 (K, N/8), qzeros int32 (K/G, N/8), scales float16 (K/G, N))``;
    nibble ``i`` of a word holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``.
    """
    return _native.pack_awq(codes, qmeta, group_size)


def quantize_pack_awq(
    weight: torch.Tensor, qmeta: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantize ``weight (N, K)`` on its grid and pack to AWQ in one pass."""
    return _native.quantize_pack_awq(weight, qmeta, group_size)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the packing: ``(codes (K, N) uint8, zeros (K/G, N) uint8)``."""
    return _native.unpack_awq(qweight, qzeros, group_size)


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """``W (N, K)`` float32 with ``W[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``."""
    return _native.dequantize_awq(qweight, qzeros, scales, group_size)


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """W4A16 matmul ``y (..., N) = x (..., K) @ dequant(W).T``, fp32 accumulation.

    The result has ``x``'s dtype. On the CPU this is the reference path (dequantise, then
    GEMM in float32).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        # let the native layer name the problem (type, or "expected (M, K)")
        return _native.awq_matmul(x, qweight, qzeros, scales, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    y = _native.awq_matmul(x2, qweight, qzeros, scales, group_size)
    return y.reshape(*lead, y.shape[-1]).to(x.dtype)


def pack_gptq(
    codes: torch.Tensor, qmeta: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ v1 layout: ``(qweight (K/8, N), qzeros (K/G, N/8) storing z-1, scales, g_idx (K,))``."""
    return _native.pack_gptq(codes, qmeta, group_size)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_gptq`: ``(codes (K, N), zeros (K/G, N))`` with the ``+1`` undone."""
    return _native.unpack_gptq(qweight, qzeros, group_size)


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """``W (N, K)`` float32 from a GPTQ v1 layer, honouring ``g_idx``."""
    return _native.dequantize_gptq(qweight, qzeros, scales, g_idx, group_size)
