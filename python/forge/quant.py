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

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from . import _native

__all__ = [
    "cuda_status",
    "build_quant_grid",
    "quantize_rtn",
    "encode_qmeta",
    "decode_qmeta",
    "HessianFactor",
    "prepare_hessian",
    "gptq_solve",
    "gptq_solve_batched",
    "prepare_hessian_batched",
    "hessian_update",
    "hessian_update_segmented",
    "GPTQResult",
    "gptq_quantize",
    "pack_awq",
    "quantize_pack_awq",
    "dequantize_awq_dense",
    "unpack_awq",
    "dequantize_awq",
    "tile_awq",
    "awq_matmul",
    "pack_gptq",
    "unpack_gptq",
    "dequantize_gptq",
]


def cuda_status() -> dict:
    """Whether the CUDA kernels are usable here, and why not: ``available``, ``reason``,
    ``device_name``, ``compute_capability``, ``nvrtc_version``, ``device_count``."""
    return _native.cuda_status()


def _via_cpu(fn, *tensors, **kw):
    """Runs a CPU-only op on CUDA inputs by a round trip through host memory."""
    dev = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
    if dev is None:
        return fn(*tensors, **kw)
    out = fn(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in tensors], **kw)
    if isinstance(out, tuple):
        return tuple(o.to(dev) if isinstance(o, torch.Tensor) else o for o in out)
    return out.to(dev)


def build_quant_grid(
    weight: torch.Tensor,
    group_size: int = 128,
    bits: int = 4,
    symmetric: bool = False,
    mode: str = "range",
    quant_max_shrink: float = 0.2,
    quant_n_grid: int = 100,
    quant_norm: float = 2.4,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Group metadata of a ``(rows, cols)`` weight (fp32, fp16, bf16 or float8_e4m3fn).

    ``mode="range"`` (alias ``"absmax"``) uses each group's min/max (absmax when
    symmetric); ``mode="mse"`` then searches ``quant_n_grid`` shrink factors in
    ``[1 - quant_max_shrink, 1 + quant_max_shrink]`` for the smallest ``sum |e|^quant_norm``.
    Rows of any length are padded with zeros to a multiple of ``group_size``.

    ``scale_inv`` (float32 ``(ceil(rows/128), ceil(cols/128))``, an FP8 weight's
    ``weight_scale_inv``) makes the weight ``e4m3 · scale_inv[r // 128, c // 128]``: the
    CUDA kernels read the FP8 bytes and scales as stored, the CPU dequantizes first; the
    grids are the same.

    Returns ``(qmeta (rows, ceil(cols/group_size), 4) uint8, maxq = 2**bits - 1, pad)``.
    """
    return _native.build_quant_grid(
        weight, group_size, bits, symmetric, mode, quant_max_shrink, quant_n_grid, quant_norm, scale_inv
    )


def quantize_rtn(
    weight: torch.Tensor, qmeta: torch.Tensor, bits: int = 4, group_size: int = 128
) -> torch.Tensor:
    """Round-to-nearest codes of ``weight (N, K)`` on its grid, as ``(K, N)`` uint8."""
    return _via_cpu(lambda w, q: _native.quantize_rtn(w, q, bits, group_size), weight, qmeta)


def encode_qmeta(scale: torch.Tensor, zero: torch.Tensor, symmetric: torch.Tensor | bool) -> torch.Tensor:
    """Encodes float32 scales, uint8 zero points and symmetric flags into ``(..., 4)`` uint8."""
    if isinstance(symmetric, bool) and isinstance(scale, torch.Tensor):
        symmetric = torch.full(scale.shape, symmetric, dtype=torch.bool)
    return _via_cpu(_native.encode_qmeta, scale, zero, symmetric)


def decode_qmeta(qmeta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decodes ``(..., 4)`` uint8 into ``(scale float32, zero uint8, symmetric bool)``."""
    return _via_cpu(_native.decode_qmeta, qmeta)


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
    and ``U = chol(H^-1)`` (upper) is computed (see :func:`prepare_hessian_batched`, the one
    implementation for both devices). When a factorisation fails the damping is multiplied
    by 10 (up to 6 times); ``retries`` reports it. With ``act_order`` inputs are processed by
    descending ``diag(H)`` (static groups keep the layout g_idx-free).
    """
    from .errors import ShapeError

    if isinstance(hessian, torch.Tensor) and hessian.dim() != 2:
        raise ShapeError(f"hessian: expected a square (C, C) matrix, got {tuple(hessian.shape)}")
    u, perm, damp, retries, dead = prepare_hessian_batched(
        hessian[None] if isinstance(hessian, torch.Tensor) else hessian, percdamp, act_order
    )
    return HessianFactor(u[0], None if perm is None else perm[0], damp[0], retries[0], dead[0])


MAX_DAMP_RETRIES = 6


TRI_LEAF = 128
"""Smallest diagonal block :func:`_tril_inverse_` inverts by a triangular solve."""


def _tri_leaf(n: int) -> int:
    """The leaf size ``b`` of :func:`_tril_inverse_` for order ``n``: ``n / 2^L`` for the largest
    ``L`` that keeps it at least ``TRI_LEAF`` (``n`` itself when ``n`` is odd or small)."""
    b = n
    while b % 2 == 0 and b // 2 >= TRI_LEAF:
        b //= 2
    return b


def _blocks(t: torch.Tensor, s: int, row: int, col: int, step: int) -> torch.Tensor:
    """View ``(B, m, s, s)`` of the ``s x s`` blocks at block row ``row + k step``, column
    ``col + k step`` (``k = 0, 1, ...``) of ``t (B, n, n)``, whatever its strides."""
    bs, rs, cs = t.stride()
    n = t.shape[-1]
    m = (n // s - max(row, col) + step - 1) // step
    return t.as_strided(
        (t.shape[0], m, s, s),
        (bs, step * s * (rs + cs), rs, cs),
        t.storage_offset() + s * (row * rs + col * cs),
    )


def _tril_inverse_(low: torch.Tensor) -> None:
    """``low ← low⁻¹`` in place for lower-triangular ``low (B, n, n)`` (zero above the
    diagonal) with a nonzero diagonal, level by level: the diagonal blocks of the leaf size
    ``b`` (:func:`_tri_leaf`, ``n = b 2^L``) are inverted in one batched triangular solve, then
    neighbouring pairs are joined, all pairs of a level in one batched product:
    ``[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]]``. A level reads only blocks the
    levels below it finished and the original ``C``, which it then replaces; its temporaries
    are the level's two products (a quarter matrix each at the top level) and, for several
    matrices at once, torch's copies of the lower levels' strided blocks. About ``n³/3``
    multiply-adds in ``2 L`` GEMM launches, against ``n³`` for a triangular solve with an
    identity right-hand side."""
    n = low.shape[-1]
    b = _tri_leaf(n)
    leaves = _blocks(low, b, 0, 0, 1)
    eye = torch.eye(b, device=low.device, dtype=low.dtype).expand_as(leaves)
    leaves.copy_(torch.linalg.solve_triangular(leaves, eye, upper=False))
    s = b
    while s < n:  # join pairs (2k, 2k + 1) of size s through their block below the diagonal
        a_inv, d_inv = _blocks(low, s, 0, 0, 2), _blocks(low, s, 1, 1, 2)
        c = _blocks(low, s, 1, 0, 2)
        c.copy_(torch.matmul(d_inv, torch.matmul(c, a_inv)).neg_())
        s *= 2


def _flip_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = src`` with rows and columns reversed, written in place (no temporary)."""
    torch.ops.aten.flip.out(src, [0, 1], out=dst)


def _half_turn_(t: torch.Tensor) -> None:
    """``t (B, n, n) ← J t J`` in place (rows and columns reversed), by swapping mirrored row
    bands a quarter of the half at a time: the temporaries are an eighth of a matrix."""
    n = t.shape[-1]
    half = n // 2
    step = max(1, -(-half // 4))
    for a in range(0, half, step):
        z = min(step, half - a)
        top, bottom = t[:, a : a + z], t[:, n - a - z : n - a]
        band = top.flip(1, 2)
        top.copy_(bottom.flip(1, 2))
        bottom.copy_(band)
    if n % 2:
        t[:, half].copy_(t[:, half].flip(1))


PREPARE_STREAMS = 8
"""Most CUDA streams (lanes of :func:`_lanes`) over which :func:`prepare_hessian_batched`
spreads its factorisations; it uses at most half as many as it has matrices."""


_LANES: dict[int, list[tuple[ThreadPoolExecutor, torch.cuda.Stream]]] = {}
_LANES_LOCK = threading.Lock()


def _lanes(device: torch.device, n: int) -> list[tuple[ThreadPoolExecutor, torch.cuda.Stream]]:
    """The first ``n`` lanes of ``device``: lane ``j`` is one host thread (its own executor)
    and one CUDA stream, always together, made once per process: a thread keeps its cuBLAS /
    cuSOLVER handles and a (handle, stream) pair its cuBLAS workspace. The first call also
    runs torch's lazy linear-algebra initialisation on this thread, which is not safe to race
    from several (pytorch/pytorch#90613: "lazy wrapper should be called at most once"). Lanes
    are made under a lock: callers on several host threads share them, never duplicate them."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    with _LANES_LOCK:
        lanes = _LANES.setdefault(key, [])
        if not lanes:
            torch.linalg.cholesky_ex(torch.ones(1, 1, device=device))
        while len(lanes) < n:
            lanes.append(
                (
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"forge-prepare-{len(lanes)}"),
                    torch.cuda.Stream(device),
                )
            )
        return lanes[:n]


def _on_streams(device: torch.device, n: int, jobs: list) -> list:
    """The results of ``jobs`` (callables), job ``i`` run on lane ``i % n`` (:func:`_lanes`:
    its own host thread and CUDA stream); in order on the current stream on the CPU, for
    ``n <= 1`` or for one job. A stream is only ever driven by its own thread, so by its own
    cuSOLVER and cuBLAS handles: Cholesky factorisations sharing one handle on concurrent
    streams were not repeatable (C = 7168 on an H100: factors 1 ulp apart between identical
    calls); one handle a stream, they are, at the same speed. The streams first wait for the
    current one, and the current one waits for all of them before this returns."""
    n = min(n, len(jobs))
    if device.type != "cuda" or n <= 1:
        return [job() for job in jobs]
    lanes = _lanes(device, n)
    here = torch.cuda.current_stream(device)
    for _, s in lanes:
        s.wait_stream(here)

    def lane(j: int) -> list:
        with torch.cuda.device(device), torch.cuda.stream(lanes[j][1]):
            return [jobs[i]() for i in range(j, len(jobs), n)]

    futures = [pool.submit(lane, j) for j, (pool, _) in enumerate(lanes)]
    try:
        done = [f.result() for f in futures]
    finally:
        for f in futures:  # every lane's launches are issued before the streams are joined
            f.exception()
        for _, s in lanes:
            here.wait_stream(s)
    return [done[i % n][i // n] for i in range(len(jobs))]


def _factor_group(hessian, ids: list[int], ids_t: torch.Tensor, perm, fixed, damp, out) -> torch.Tensor:
    """Writes ``U`` of matrices ``ids`` (``ids_t`` on the device) into ``out``; returns their
    success mask (on the device). No host sync. Consecutive ``ids`` (every first attempt)
    are factorised in their own slice of ``out``; the scattered ids of a retry in a copy."""
    c = hessian.shape[-1]
    i0 = ids[0]
    in_place = ids == list(range(i0, i0 + len(ids)))
    if in_place:
        work = out[i0 : i0 + len(ids)]
    else:
        work = torch.empty(len(ids), c, c, device=hessian.device, dtype=torch.float32)
    # work[m] = J Pᵀ (H + damp I) P J: processing order, reversed
    for m, i in enumerate(ids):
        if perm is None:
            _flip_into(hessian[i], work[m])
        else:
            rev = perm[i].flip(0)
            torch.index_select(hessian[i].index_select(0, rev), 1, rev, out=work[m])
    d = fixed[ids_t].flip(1) if perm is None else torch.gather(fixed[ids_t], 1, perm[ids_t].flip(1))
    work.diagonal(dim1=1, dim2=2).copy_(d + damp[ids_t, None])
    # L with J Pᵀ(H + damp I)P J = L Lᵀ, in place: an upper factorisation of the transposed
    # view, which is column-major (LAPACK's and cuSOLVER's layout, so torch needs no copy),
    # leaves Lᵀ there and L in `work`.
    info = torch.empty(len(ids), device=hessian.device, dtype=torch.int32)
    torch.linalg.cholesky_ex(work.mT, upper=True, out=(work.mT, info))
    _tril_inverse_(work)  # L⁻¹
    _half_turn_(work)  # U = J L⁻¹ J
    if not in_place:
        for m, i in enumerate(ids):
            out[i].copy_(work[m])
    # A NaN or Inf anywhere makes the matrix's sum non-finite (one pass, where isfinite
    # runs four); a sum beyond float32's range fails it too, and it is retried damped.
    good = (info == 0) & torch.isfinite(work.sum(dim=(1, 2)))
    return good & (work.diagonal(dim1=1, dim2=2) > 0).all(1)


def prepare_hessian_batched(hessian: torch.Tensor, percdamp: float = 0.01, act_order: bool = False):
    """:func:`prepare_hessian` for a batch ``(E, C, C)`` (e.g. one Hessian per expert), on the
    tensor's device (cuSOLVER/cuBLAS on CUDA, LAPACK on the CPU, through torch.linalg).

    Returns ``(hinv_chol (E, C, C), perm (E, C) int64 or None, damp list, retries list,
    dead list)``.

    ``U`` with ``H⁻¹ = UᵀU`` comes from ONE Cholesky factorisation and one triangular solve:
    with ``J`` the order reversal, ``J H J = L Lᵀ`` gives ``H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J)`` and
    ``J L⁻¹ J`` is upper triangular with a positive diagonal, so it is the Cholesky factor
    (unique). ``L⁻¹`` is formed by blocks (:func:`_tril_inverse_`): about ``2/3 C³``
    multiply-adds in all, against about ``2 C³`` for factorising, inverting and factorising
    again. Matrices are factorised one at a time on ``PREPARE_STREAMS`` CUDA streams (C >
    2048) or the whole batch at once, each in its own slice of the output (the Cholesky
    factor, its inverse and the reversal all in place): besides the result, the working
    memory measured about half a matrix per matrix of a batched group (64 × 2048² on an
    H100) and about one per matrix factorised alone (6 × 2200²), with at most half as many
    of those in flight as the batch holds.
    One host sync per attempt. fp32 throughout (TF32 is never enabled here; torch's default).
    """
    from .errors import DTypeError, HessianError, InvalidValueError, ShapeError

    if not isinstance(hessian, torch.Tensor):
        raise DTypeError(f"hessian: expected a torch.Tensor, got {type(hessian).__name__}")
    if hessian.dim() != 3 or hessian.shape[1] != hessian.shape[2] or hessian.shape[1] == 0:
        raise ShapeError(f"hessian: expected (E, C, C), got {tuple(hessian.shape)}")
    if hessian.dtype != torch.float32:
        raise DTypeError(f"hessian: expected dtype torch.float32, got {hessian.dtype}")
    if not (percdamp >= 0 and percdamp < float("inf")):
        raise InvalidValueError(f"percdamp: must be a finite number >= 0 (got {percdamp})")
    if not bool(torch.isfinite(torch.stack(torch.aminmax(hessian))).all()):  # one pass, no (E, C, C) mask
        raise InvalidValueError("hessian: holds NaN or Inf values")
    e, c, _ = hessian.shape
    diag = torch.diagonal(hessian, dim1=1, dim2=2)
    if bool((diag < 0).any()):
        raise InvalidValueError("hessian: diagonal must be >= 0 (a Hessian is X^T X)")
    dead_mask = diag == 0
    dead = dead_mask.sum(1).tolist()
    fixed = torch.where(dead_mask, torch.ones_like(diag), diag)
    perm = torch.sort(diag, dim=1, descending=True, stable=True).indices if act_order else None
    damp = (percdamp * fixed.double().mean(1)).float()
    damp = torch.where(damp > 0, damp, torch.full_like(damp, torch.finfo(torch.float32).tiny))
    out = torch.empty_like(hessian)
    # Matrices factorised together (working memory ~0.5 x sub matrices): large ones one at a
    # time (torch's batched Cholesky of 7168² matrices measured 2x slower than a loop on an
    # H100), small ones all at once (64 x 2048² on an H100: 36.3 ms, against 46.4 in groups
    # of an eighth on 4 streams; benches/results-h100-bench_cuda-2026-11-27.json). On CUDA the
    # groups go round-robin over PREPARE_STREAMS streams, each driven by its own host thread
    # (_on_streams): a single Cholesky keeps a fraction of the GPU busy (its panel steps are
    # latency-bound), several in flight fill it.
    sub = 1 if c > 2048 else e
    retries = [0] * e
    todo = list(range(e))
    for attempt in range(MAX_DAMP_RETRIES + 1):
        todo_t = torch.tensor(todo, device=hessian.device)  # one copy; slices of it need none
        jobs = [
            functools.partial(
                _factor_group, hessian, todo[j : j + sub], todo_t[j : j + sub], perm, fixed, damp, out
            )
            for j in range(0, len(todo), sub)
        ]
        # At most half as many lanes as matrices: each matrix in flight held about one
        # matrix of working memory (6 x 2200² on 8 lanes measured 2.12x the Hessians), so the
        # in-flight ones stay within the batch's own size.
        oks = _on_streams(hessian.device, min(PREPARE_STREAMS, max(1, len(jobs) // 2)), jobs)
        ok = torch.cat(oks).tolist()
        todo = [i for i, good in zip(todo, ok, strict=True) if not good]
        if not todo:
            break
        if attempt == MAX_DAMP_RETRIES:
            raise HessianError(
                f"hessian: Cholesky failed after {MAX_DAMP_RETRIES} retries for matrices {todo} "
                "(not positive definite)"
            )
        for i in todo:
            retries[i] += 1
            damp[i] *= 10
    return out, perm, damp.tolist(), retries, dead


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
    if isinstance(weight_t, torch.Tensor) and weight_t.is_cuda and weight_t.dim() == 2:
        if perm is not None:
            perm = perm[None]
        codes, deq = gptq_solve_batched(
            weight_t[None], hinv_chol[None], qmeta[None], bits, group_size, block_size, perm
        )
        return codes[0], deq[0]
    return _native.gptq_solve(weight_t, hinv_chol, qmeta, bits, group_size, block_size, perm)


def gptq_solve_batched(
    weight_t: torch.Tensor,
    hinv_chol: torch.Tensor,
    qmeta: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    block_size: int = 128,
    perm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gptq_solve` over a batch of matrices of one shape (all experts of a layer).

    ``weight_t (E, C, R)``, ``hinv_chol (E, C, C)``, ``qmeta (E, R, ceil(C/G), 4)``,
    ``perm (E, C)`` int64 or ``None``. Returns ``(codes (E, C, R) uint8, dequantized
    (E, C, R) float32)``. On CUDA all matrices are solved together by the fused kernels
    (block size at most 128).
    """
    return _native.gptq_solve_batched(weight_t, hinv_chol, qmeta, bits, group_size, block_size, perm)


def hessian_update(
    hessian: torch.Tensor, x: torch.Tensor, alpha: float = 1.0, check_finite: bool = True
) -> torch.Tensor:
    """In place ``hessian (D, D) += alpha * x.T @ x`` in float32, for inputs ``x (..., D)``.

    The GPTQ Hessian of a linear layer is ``2/T * sum x x^T`` over its T calibration
    tokens: call this per batch with ``alpha = 2 / T_total`` (or normalise at the end).
    ``check_finite=False`` skips the NaN/Inf pass over a CUDA ``x`` (a read and a host sync)
    for callers that detect non-finite inputs otherwise (NaN or Inf in ``x`` shows on the
    Hessian's diagonal); CPU inputs are always checked.
    """
    if isinstance(x, torch.Tensor) and x.dim() > 2:
        x = x.reshape(-1, x.shape[-1])
    _native.hessian_update(hessian, x, float(alpha), check_finite)
    return hessian


def hessian_update_segmented(
    hessian: torch.Tensor,
    x: torch.Tensor,
    idx: torch.Tensor,
    offsets: torch.Tensor,
    alpha: float = 1.0,
    check_finite: bool = True,
    overwrite: bool = False,
) -> torch.Tensor:
    """Per-expert Hessians in one call: ``hessian[e] += alpha * X_e.T @ X_e`` with
    ``X_e = x[idx[offsets[e]:offsets[e+1]]]`` (the tokens routed to expert ``e``).

    ``hessian (E, D, D)`` float32, ``x (T, D)``, ``idx`` int32, ``offsets (E + 1,)`` int32.
    The offsets and the indices' range are always checked; ``check_finite=False`` skips the
    NaN/Inf pass over a CUDA ``x`` (a read of all of ``x`` and a host sync), as for
    :func:`hessian_update` (NaN or Inf in a routed row shows on its expert's diagonal).
    ``overwrite=True`` writes fresh products, ``hessian[e] = alpha * X_e.T @ X_e`` (zeros for
    an expert without rows), without reading ``hessian``: bit for bit what adding into a
    zeroed ``hessian`` gives, without the zeroing pass or the read of H.
    """
    _native.hessian_update_segmented(hessian, x, idx, offsets, float(alpha), check_finite, overwrite)
    return hessian


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

        raise ShapeError(
            f"hessian: expected ({k}, {k}) for weight {tuple(weight.shape)}, got {tuple(hessian.shape)}"
        )
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
    weight: torch.Tensor,
    qmeta: torch.Tensor,
    group_size: int = 128,
    check_finite: bool = True,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantize ``weight (N, K)`` on its grid and pack to AWQ in one pass.

    ``check_finite=False`` skips the NaN/Inf checks of a CUDA weight (one extra read) and of
    ``scale_inv`` (a host sync each) when the grid was built from the same weight and scales,
    which already checked them. ``scale_inv``: an FP8 weight's block scales, as for
    :func:`build_quant_grid`.
    """
    return _native.quantize_pack_awq(weight, qmeta, group_size, check_finite, scale_inv)


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the packing: ``(codes (K, N) uint8, zeros (K/G, N) uint8)``."""
    return _via_cpu(lambda a, b: _native.unpack_awq(a, b, group_size), qweight, qzeros)


def tile_awq(qweight: torch.Tensor) -> torch.Tensor:
    """Repacks an AWQ ``qweight (K, N/8)`` int32 into the tile layout of the CUDA tiled GEMV
    (``N % 16 == 0``, ``K % 64 == 0``): int32 ``(N/16, K/64, 32, 4)``, a permutation of the
    same nibbles into the ``mma.m16n8k16`` A-fragment order (``cuda/gemm.cu`` documents it).

    On CUDA the repack runs on the tensor's device and stream (the runtime does it once per
    layer, at its first decode-sized call); on the CPU it is the reference it matches bit
    for bit.
    """
    from .errors import DTypeError, ShapeError
    from .runtime import _current_stream, _device_index

    if not isinstance(qweight, torch.Tensor) or not qweight.is_cuda:
        return _native.tile_awq(qweight)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise DTypeError(f"qweight: expected a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if not _native.tile_shape_ok(n, k, 64):  # 64: any K % 64 == 0 is whole chunks
        raise ShapeError(f"qweight: the tile layout needs N % 16 == 0 and K % 64 == 0, got K={k} N={n}")
    qweight = qweight.contiguous()
    out = torch.empty(n // 16, k // 64, 32, 4, dtype=torch.int32, device=qweight.device)
    index = _device_index(qweight.device)
    _native.w4a16_tile_repack_launch(qweight.data_ptr(), out.data_ptr(), n, k, index, _current_stream(index))
    return out


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """``W (N, K)`` float32 with ``W[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``.

    CUDA tensors are dequantized on their device (:func:`dequantize_awq_dense`), others by
    the CPU reference; both give the same bits."""
    if all(isinstance(t, torch.Tensor) and t.is_cuda for t in (qweight, qzeros, scales)):
        return dequantize_awq_dense(qweight, qzeros, scales, group_size, torch.float32).t().contiguous()
    return _via_cpu(lambda a, b, c: _native.dequantize_awq(a, b, c, group_size), qweight, qzeros, scales)


def dequantize_awq_dense(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """CUDA AWQ tensors dequantized to a dense ``(K, N)`` of ``dtype`` (qweight's own order,
    so ``x @ W`` is the layer) in one kernel on the tensors' device and current stream.

    ``(q - z) * scale`` is computed in float32 and rounded once to ``dtype``; for bfloat16
    the scale is first rounded to bfloat16. float16 and bfloat16 outputs are therefore the
    very weights forge's fused W4A16 kernels multiply, and float32 is exact (the transpose of
    :func:`dequantize_awq`). Needs ``N % 8 == 0``, ``K % group_size == 0`` and ``scales``
    16-byte aligned (a tensor of its own, or a view starting on a 16-byte boundary).
    """
    from .errors import DTypeError, InvalidValueError, ShapeError
    from .runtime import _check_device_awq, _dense_launch, _device_index

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    if not isinstance(qweight, torch.Tensor) or not qweight.is_cuda:
        raise DTypeError("qweight: expected a CUDA tensor (dequantize_awq takes CPU tensors)")
    if not isinstance(group_size, int) or group_size <= 0:
        raise InvalidValueError(f"group_size: expected a positive int, got {group_size!r}")
    _, k, n = _check_device_awq(qweight, qzeros, scales, group_size, qweight.device, stacked=False)
    if k % group_size or n % 8 or k == 0 or n == 0:
        raise ShapeError(
            f"AWQ tensors: need K % group_size == 0 and N % 8 == 0, got K={k} N={n} G={group_size}"
        )
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if scales.data_ptr() % 16:
        scales = scales.clone()
    return _dense_launch(qweight, qzeros, scales, k, n, group_size, dtype, _device_index(qweight.device))


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """W4A16 matmul ``y (..., N) = x (..., K) @ dequant(W).T``, fp32 accumulation.

    The result has ``x``'s dtype. On the CPU this is the reference path (dequantise, then
    GEMM in float32); CUDA tensors run the fused W4A16 kernel (fp16/bf16 activations,
    fp32 accumulation) reading the AWQ tensors as they are, or, for out features that are
    not a multiple of 32 (which the kernels do not take), the weights dequantized as the
    kernels take them and one cuBLAS product.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        # let the native layer name the problem (type, or "expected (M, K)")
        return _native.awq_matmul(x, qweight, qzeros, scales, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x.is_cuda:
        x2 = x2.to(torch.float32)
    elif x2.dtype not in (torch.float16, torch.bfloat16):
        x2 = x2.to(torch.float16)
    from .runtime import _cuda_gemm, fused_takes

    if (
        x.is_cuda
        and isinstance(scales, torch.Tensor)
        and scales.dim() == 2
        and not fused_takes(scales.shape[-1])
    ):
        # the runtime's dense route (it checks the tensors itself)
        y = _cuda_gemm(x2, qweight, qzeros, scales, group_size)
    else:
        y = _native.awq_matmul(x2.contiguous(), qweight, qzeros, scales, group_size)
    return y.reshape(*lead, y.shape[-1]).to(x.dtype)


def pack_gptq(
    codes: torch.Tensor, qmeta: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ v1 layout: ``(qweight (K/8, N), qzeros (K/G, N/8) storing z-1, scales, g_idx (K,))``."""
    return _via_cpu(lambda a, b: _native.pack_gptq(a, b, group_size), codes, qmeta)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_gptq`: ``(codes (K, N), zeros (K/G, N))`` with the ``+1`` undone."""
    return _via_cpu(lambda a, b: _native.unpack_gptq(a, b, group_size), qweight, qzeros)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    group_size: int = 128,
) -> torch.Tensor:
    """``W (N, K)`` float32 from a GPTQ v1 layer, honouring ``g_idx``."""
    return _via_cpu(
        lambda a, b, c, d: _native.dequantize_gptq(a, b, c, d, group_size), qweight, qzeros, scales, g_idx
    )
