"""`quantize_model`, `inspect` and `verify`: the Python front door of the quantization run.

Glue only: options are passed to the Rust orchestrator (`forge-run`, the same code as the
``forge-rs`` command line), which streams the checkpoint layer by layer with the GIL released.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import _native

__all__ = ["QuantizeReport", "VerifyReport", "quantize_model", "inspect", "verify"]


@dataclass(frozen=True)
class QuantizeReport:
    """What a finished run did."""

    out_dir: str
    arch: str
    """Detected model family (``deepseek``, ``qwen-moe``, ``mixtral``, ``generic``)."""
    quantizer: str
    """``rtn-range`` or ``rtn-mse``."""
    quantized: int
    """Number of linears written as qweight/qzeros/scales."""
    modules_to_not_convert: list[str]
    """Modules left unquantized, as written to config.json."""
    units: int
    """Decoder layers plus the non-layer tensors."""
    resumed_units: int
    """Units taken over from an interrupted run."""
    bytes_in: int
    bytes_out: int
    shards: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    """Decisions worth knowing (fused groups pulled out, unpackable shapes skipped)."""


@dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify`."""

    ok: bool
    problems: list[str]
    tensors: int
    quantized: int
    unquantized: int
    group_size: int
    shards: int


def _patterns(name: str, value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    out = list(value)
    if not all(isinstance(p, str) for p in out):
        raise TypeError(f"{name} must be a string or an iterable of strings")
    return out


def quantize_model(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    method: Literal["rtn", "mse"] = "rtn",
    group_size: int = 128,
    symmetric: bool = False,
    exclude: str | Sequence[str] = (),
    include: str | Sequence[str] | None = None,
    max_shard_size: str | int = "5GB",
    resume: bool = False,
    overwrite: bool = False,
    threads: int | None = None,
    progress: bool = True,
    *,
    device: str = "cpu",
    default_excludes: bool = True,
    skip_unpackable: bool = False,
    mse_grid: int = 100,
    mse_shrink: float = 0.2,
    mse_norm: float = 2.4,
) -> QuantizeReport:
    """Quantizes a Hugging Face safetensors folder to a 4-bit AWQ ("gemm") folder that vLLM loads.

    The model is streamed one decoder layer at a time (memory bounded by one layer); every linear
    inside the decoder layers is quantized except routers, norms, embeddings, ``lm_head``, MTP
    layers and the family's default exclusions (DeepSeek: ``kv_b_proj``; turn off with
    ``default_excludes=False``). Patterns in ``exclude`` / ``include`` select modules by whole
    dotted name segments (``"kv_b_proj"``, ``"self_attn"``, ``"mlp.experts"``) or by glob (``*``).

    ``method="rtn"`` rounds to nearest on the min/max grid; ``"mse"`` refines each group's scale
    with the MSE / L^p search first. ``resume=True`` continues an interrupted run in ``out_dir``
    and produces the same bytes as an uninterrupted one; a non-empty ``out_dir`` is refused
    unless ``overwrite`` or ``resume``. ``device="cuda"`` (or ``"cuda:N"``) runs the grid and
    the fused quantize+pack on the GPU; the output bytes are identical to a CPU run.

    Raises ``forge.errors.CheckpointError`` for unreadable or inconsistent input,
    ``ShapeError`` when a selected linear cannot be packed with ``group_size``,
    ``InvalidValueError`` for NaN/Inf weights or bad options, ``OSError`` for I/O failures
    (e.g. a full disk).
    """
    if isinstance(max_shard_size, int):
        max_shard_size = str(max_shard_size)
    out = _native.quantize_model(
        os.fspath(model_dir),
        os.fspath(out_dir),
        method=method,
        group_size=group_size,
        symmetric=symmetric,
        exclude=_patterns("exclude", exclude),
        include=_patterns("include", include),
        default_excludes=default_excludes,
        skip_unpackable=skip_unpackable,
        max_shard_size=max_shard_size,
        resume=resume,
        overwrite=overwrite,
        threads=threads,
        device=device,
        progress=progress,
        mse_grid=mse_grid,
        mse_shrink=mse_shrink,
        mse_norm=mse_norm,
    )
    return QuantizeReport(**out)


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Layers, experts, dtypes, sizes and quantization status of a checkpoint folder (headers only)."""
    return _native.inspect(os.fspath(path))


def verify(path: str | os.PathLike[str], *, raise_on_error: bool = True) -> VerifyReport:
    """Checks that ``path`` is a complete, consistent AWQ checkpoint for vLLM.

    Every expected tensor present with the right shape and dtype, the index matching the shards,
    config.json matching the tensors, no stray tensors. With ``raise_on_error`` a failing check
    raises ``forge.errors.CheckpointError`` listing the problems.
    """
    r = VerifyReport(**_native.verify(os.fspath(path)))
    if raise_on_error and not r.ok:
        from .errors import CheckpointError

        listed = "\n  ".join(r.problems)
        raise CheckpointError(f"{os.fspath(path)}: {len(r.problems)} problem(s):\n  {listed}")
    return r
