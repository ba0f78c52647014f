"""The spec's ``GPTQ`` class: a thin object wrapper over :mod:`forge.quant`."""

from __future__ import annotations

import torch

from . import quant

__all__ = ["GPTQ"]


class GPTQ:
    """Holds the quantization settings; methods mirror spec gptq-core-qmeta4 §7.

    >>> g = GPTQ(bits=4, group_size=128, symmetric=False)
    >>> # qmeta, maxq, pad = g.build_quant_grid(W, mode="mse")    # W: (N, K)
    >>> # codes = g.solver(W.T.contiguous(), factor.hinv_chol, qmeta, maxq)
    """

    def __init__(self, bits: int = 4, group_size: int = 128, symmetric: bool = False, block_size: int = 128):
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.block_size = block_size

    def build_quant_grid(
        self,
        weight: torch.Tensor,
        group_size: int | None = None,
        bits: int | None = None,
        symmetric: bool | None = None,
        mode: str = "absmax",
        quant_max_shrink: float = 0.2,
        quant_n_grid: int = 100,
        quant_norm: float = 2.4,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Grid of ``weight (rows, cols)``: ``(qmeta (rows, G, 4), maxq scalar tensor, pad)``."""
        qmeta, maxq, pad = quant.build_quant_grid(
            weight,
            self.group_size if group_size is None else group_size,
            self.bits if bits is None else bits,
            self.symmetric if symmetric is None else symmetric,
            mode,
            quant_max_shrink,
            quant_n_grid,
            quant_norm,
        )
        return qmeta, torch.tensor(maxq), pad

    def prepare_hessian(self, hessian: torch.Tensor, percdamp: float = 0.01, act_order: bool = False):
        """See :func:`forge.prepare_hessian`."""
        return quant.prepare_hessian(hessian, percdamp, act_order)

    def solver(
        self,
        weight: torch.Tensor,
        hessian_inv: torch.Tensor,
        qmeta: torch.Tensor,
        maxq: torch.Tensor | int | None = None,
        group_size: int | None = None,
        bits: int | None = None,
        perm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """GPTQ on ``weight (C, R)`` (transposed); returns ``(C, R)`` uint8 codes."""
        bits = self.bits if bits is None else bits
        if maxq is not None and int(maxq) != (1 << bits) - 1:
            from .errors import InvalidValueError

            raise InvalidValueError(f"maxq: expected {(1 << bits) - 1} for {bits} bits, got {int(maxq)}")
        codes, _ = quant.gptq_solve(
            weight,
            hessian_inv,
            qmeta,
            bits,
            self.group_size if group_size is None else group_size,
            self.block_size,
            perm,
        )
        return codes
