"""W4A16 inference modules over vLLM AWQ "gemm" tensors: a linear and grouped MoE experts.

Both keep the checkpoint's tensors as they are stored (``qweight`` int32 ``[K, N/8]``,
``qzeros`` int32 ``[K/G, N/8]``, ``scales`` fp16 ``[K/G, N]``, nibble ``i`` of a word holding
column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``W[n, k] = (q - z) * s``) and pick a kernel by
the activation's device:

* CUDA: forge's fused W4A16 kernel. Eager calls go straight to :func:`_cuda_gemm` (no
  dispatcher round trip); under ``torch.compile`` the ``torch.ops.forge.awq_gemm`` custom op
  (with a fake implementation) is traced instead, and runs the same function. Each call
  allocates its output (and any split-K scratch) with torch's caching allocator, launches
  on torch's current stream through one native call taking plain integers, and never
  synchronises with the host, so ``torch.cuda.graph`` and ``mode="reduce-overhead"``
  capture it. Kernel plans are cached per shape in Rust (first call per shape compiles or
  loads the kernels and queries occupancy; later calls are a map lookup).
  Decode-sized calls of :func:`awq_linear` / :class:`AwqLinear` (at most
  :data:`TILED_MAX_M` rows) run the tiled GEMV instead: the codes are repacked once per
  layer into the tile layout (:func:`forge.tile_awq`, contiguous per 16 outputs and in
  tensor-core fragment order) and kept beside the AWQ tensors (:data:`TILED_DECODE`).
  :class:`AwqExperts` with few (token, expert) pairs (decode: up to
  :data:`GROUPED_MAX_PAIRS`) runs each projection as one grouped GEMV over all experts
  (``torch.ops.forge.awq_moe_gemv``): the pairs are sorted by expert on the GPU into a
  segment table (:func:`moe_route`: one kernel launch; :func:`moe_segments` is the same in
  torch ops), nothing is read back, so that path captures too; with more pairs (batched
  decode, prefill: past :data:`GROUPED_TC_MIN_SHARE` per expert) the same two launches run
  the grouped form on tensor cores (the wgmma GEMM on sm_90, the mma.sync GEMM on other GPUs
  from sm_80; :data:`GROUPED_TC`). Calls of at least
  :data:`DENSE_MIN_ROWS` rows (prefill, evaluation) dequantize the weight into a transient
  dense copy and multiply it with cuBLAS (:data:`DENSE_ROUTE`).
* CPU: PyTorch's tinygemm int4 kernel (``aten._weight_int4pack_mm_for_cpu``) for bf16 and
  fp16 activations. The weight is converted once, on the first CPU forward of each dtype:
  codes are unpacked to ``[N, K]`` and repacked by ``aten._convert_weight_to_int4pack_for_cpu``;
  tinygemm computes ``w = (q - 8) * scale + zero``, so the AWQ zero point becomes
  ``zero = (8 - z) * scale`` (``scales_and_zeros [K/G, N, 2]`` in the activation dtype).
  Where the kernel refuses the shape (``N % 16``, group sizes other than 32..256) and for
  float32 activations (tinygemm's fp32 path measured 10-60x slower than a dense fp32 GEMM
  here), the weight is dequantized once into a cached dense copy in the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import _native
from .errors import DeviceError, DTypeError, ShapeError
from .quant import awq_matmul, dequantize_awq, tile_awq, unpack_awq

__all__ = [
    "AwqLinear",
    "AwqExperts",
    "awq_linear",
    "awq_moe_gemv",
    "cpu_int4_supported",
    "moe_combine",
    "moe_route",
    "moe_segments",
    "prepare_decode",
    "silu_mul",
]

PACK = 8  # int4 values per int32 word

# --------------------------------------------------------------------------- CUDA path

_GEMM_DTYPES = (torch.float16, torch.bfloat16)
_AWQ_DTYPES = (("qweight", torch.int32), ("qzeros", torch.int32), ("scales", torch.float16))


def _check_device_awq(qweight, qzeros, scales, group_size: int, dev, stacked: bool) -> tuple[int, int, int]:
    """``(experts, K, N)`` of AWQ tensors for the CUDA launches (``experts`` is 1 unless
    ``stacked``: ``qweight [E, K, N/8]`` etc.), checked against each other and ``dev``."""
    for (name, dtype), t in zip(_AWQ_DTYPES, (qweight, qzeros, scales), strict=True):
        if t.device != dev:
            raise DeviceError(f"{name}: expected a tensor on {dev} like x, got {t.device}")
        if t.dtype != dtype:
            raise DTypeError(f"{name}: expected {dtype}, got {t.dtype}")
    lead = tuple(qweight.shape[: int(stacked)])
    k, n = (qweight.shape[-2] if qweight.dim() >= 2 else 0), scales.shape[-1]
    if (
        tuple(qweight.shape) != (*lead, k, n // PACK)
        or tuple(qzeros.shape) != (*lead, k // group_size, n // PACK)
        or tuple(scales.shape) != (*lead, k // group_size, n)
    ):
        raise ShapeError(
            f"{'stacked ' if stacked else ''}AWQ tensors for group_size {group_size}: got qweight "
            f"{tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    return (lead[0] if stacked else 1), k, n


# split-K scratch bytes per (device, M, N, K, G), asked of the native plan once per shape
_WORKSPACE: dict[tuple[int, int, int, int, int], int] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """Raw handle of torch's current stream on CUDA device ``index`` (what
    ``torch.cuda.current_stream(index).cuda_stream`` returns, without building a Stream)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _device_index(dev: torch.device) -> int:
    """The CUDA ordinal of ``dev`` (the current device for a bare ``cuda``)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _launch_io(x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The W4A16 launches' activations and output: ``x`` as a contiguous, 16-byte aligned
    fp16/bf16 tensor (other dtypes through fp16), an empty ``y (..., n)`` in that dtype, the
    row count and the CUDA device index."""
    xa = x if x.dtype in _GEMM_DTYPES else x.to(torch.float16)
    xa = xa.contiguous()
    if xa.data_ptr() % 16:  # a view into the middle of a row
        xa = xa.clone()
    y = torch.empty((*x.shape[:-1], n), dtype=xa.dtype, device=x.device)
    index = _device_index(x.device)
    return xa, y, xa.numel() // k, index


#: Whether CUDA calls of at least :data:`DENSE_MIN_ROWS` rows (prefill, evaluation) dequantize
#: the layer into a transient dense weight in the activation dtype
#: (:func:`forge.dequantize_awq_dense`: one memory-bound kernel, the very weights the fused
#: kernel multiplies) and multiply it with cuBLAS (``torch.mm``), as vLLM's AWQ layer does for
#: many tokens. Once a call has that many rows, cuBLAS's bf16/fp16 GEMM outruns the fused W4A16
#: kernel by more than the dequantization costs. The product then follows torch's cuBLAS
#: settings, as a 16-bit ``nn.Linear`` does; the fused kernel always accumulates in fp32.
DENSE_ROUTE = True
#: Fewest rows for the dense route (:data:`DENSE_ROUTE`). On an H200 the route took 0.66-0.78x
#: the fused kernel's time at 4096 rows on the DeepSeek-V3 shapes (``benches/bench_cuda.py
#: --only dense``), and a forged 1.2B Llama's forward over 4096-16384 tokens ran 1.14-1.23x
#: faster with it (``benches/bench_prefill.py``). From 1024 rows the kernels alone gained
#: 1.00-1.16x, but the model's forward at 1024-2048 tokens measured 0.73-1.40x over repeated
#: runs, so the route starts at 4096. Since the fused kernel's 256-token tile (session 47) the
#: route runs at 0.94-0.98x the fused kernel's speed at 1024 rows, 1.03-1.17x at 2048 and
#: 1.10-1.31x at 4096 (same bench), so 4096 stays; on 14 dense-model shapes (session 48,
#: ``bench_cuda.py --only dense --shapes ...``) it ran 1.05-1.25x at 4096 rows on every shape
#: and 0.92-1.13x at 2048.
DENSE_MIN_ROWS = 4096
#: Out features of the fused kernels are a multiple of this (AWQ allows any multiple of
#: :data:`PACK`): other layers take the dense route at every M (:func:`fused_takes`).
FUSED_N_MULTIPLE = _native.W4A16_N_MULTIPLE
#: Largest transient dense weight, in bytes, the dense route makes; larger layers keep the
#: fused kernel (a DeepSeek-V3 dense MLP projection, 7168 x 18432, takes 264 MB in bf16).
DENSE_MAX_BYTES = 1 << 30


def fused_takes(out_features: int) -> bool:
    """Whether the fused W4A16 kernels take ``out_features`` (:data:`FUSED_N_MULTIPLE`)."""
    return out_features % FUSED_N_MULTIPLE == 0


def _dense_launch(
    qweight, qzeros, scales, k: int, n: int, group_size: int, dtype, index: int
) -> torch.Tensor:
    """The dense dequantization's launch on checked, contiguous AWQ tensors of CUDA device
    ``index`` (``scales`` 16-byte aligned): a new ``(K, N)`` of ``dtype`` on the current
    stream (:func:`forge.dequantize_awq_dense`)."""
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _native.awq_dequant_launch(
        qweight.data_ptr(),
        qzeros.data_ptr(),
        scales.data_ptr(),
        out.data_ptr(),
        str(dtype),
        n,
        k,
        group_size,
        index,
        _current_stream(index),
    )
    return out


def _cuda_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x (..., K) @ dequant(W).T`` on CUDA in ``x``'s dtype (fp16/bf16 natively; other
    dtypes through fp16). Output and scratch come from torch's allocator on the current
    stream, the kernel is launched on that stream, and nothing waits for the GPU. Calls of
    many rows take the dense route (:data:`DENSE_ROUTE`), and so does every call on out
    features the fused kernels do not take (:func:`fused_takes`): the weights dequantized as
    the kernels take them, then one cuBLAS product."""
    dev = x.device
    _, k, n = _check_device_awq(qweight, qzeros, scales, group_size, dev, stacked=False)
    if x.shape[-1] != k:
        raise ShapeError(f"x: expected last dim {k} (in_features), got {tuple(x.shape)}")
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    xa, y, m, index = _launch_io(x, k, n)
    if m == 0:
        return y.to(x.dtype)
    if not fused_takes(n) or (
        DENSE_ROUTE
        and m >= DENSE_MIN_ROWS
        and k * n * xa.element_size() <= DENSE_MAX_BYTES
        and scales.data_ptr() % 16 == 0  # else the fused kernel names it
    ):
        if scales.data_ptr() % 16:  # the dequantization reads it 16 bytes at a time
            scales = scales.clone()
        w = _dense_launch(qweight, qzeros, scales, k, n, group_size, xa.dtype, index)
        torch.mm(xa.view(m, k), w, out=y.view(m, n))
        return y if y.dtype == x.dtype else y.to(x.dtype)
    key = (index, m, n, k, group_size)
    ws_bytes = _WORKSPACE.get(key)
    if ws_bytes is None:
        ws_bytes = _WORKSPACE[key] = _native.w4a16_workspace_bytes(index, m, n, k, group_size)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    _native.w4a16_launch(
        xa.data_ptr(),
        xa.dtype == torch.bfloat16,
        m,
        k,
        n,
        group_size,
        qweight.data_ptr(),
        qzeros.data_ptr(),
        scales.data_ptr(),
        y.data_ptr(),
        0 if ws is None else ws.data_ptr(),
        ws_bytes,
        index,
        _current_stream(index),
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)


#: Most tokens (rows of ``x``) the tiled GEMV takes: two 8-token tiles of its MMA's B columns.
TILED_MAX_M = _native.TILED_MAX_M
#: Whether :func:`awq_linear` (so :class:`AwqLinear`) keeps a tile-layout copy of the codes
#: (:func:`forge.tile_awq`) for decode-sized CUDA calls (at most :data:`TILED_MAX_M` rows).
#: The copy is made once per layer, at its first such call outside CUDA-graph capture or by
#: :func:`prepare_decode` (which :func:`forge.load_quantized` calls on CUDA unless told not
#: to), and costs one more ``K·N/2`` bytes of GPU memory per layer (the AWQ tensors stay, for
#: the larger calls); set this to ``False`` before the first forward to keep memory at one copy.
#: Under ``torch.compile`` (transformers' ``generate`` with a static cache compiles its decode
#: steps) the custom op takes the copy made before compiling.
TILED_DECODE = True


def tiled_ok(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether the tile layout and its GEMV take this shape: ``N % 16 == 0``,
    ``G % 64 == 0`` and ``K % G == 0`` (all positive)."""
    return _native.tile_shape_ok(out_features, in_features, group_size)


def _cuda_gemv_tiled(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qweight_tiled: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """:func:`_cuda_gemm` for at most :data:`TILED_MAX_M` rows, reading the codes from
    ``qweight_tiled`` (:func:`forge.tile_awq` of ``qweight``, which names the shape; checked
    here, since the kernel gets its address only): one launch, no scratch, nothing read back
    (CUDA-graph safe)."""
    _, k, n = _check_device_awq(qweight, qzeros, scales, group_size, x.device, stacked=False)
    if x.shape[-1] != k:
        raise ShapeError(f"x: expected last dim {k} (in_features), got {tuple(x.shape)}")
    want = (n // 16, k // 64, 32, 4)
    t = qweight_tiled
    if tuple(t.shape) != want or t.dtype != torch.int32 or t.device != x.device or not t.is_contiguous():
        raise ShapeError(
            f"tiles: expected int32 {want}, contiguous, on {x.device} (forge.tile_awq of qweight), "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    qzeros, scales = qzeros.contiguous(), scales.contiguous()
    xa, y, m, index = _launch_io(x, k, n)
    if m == 0:
        return y.to(x.dtype)
    _native.w4a16_tiled_launch(
        xa.data_ptr(),
        xa.dtype == torch.bfloat16,
        m,
        k,
        n,
        group_size,
        qweight_tiled.data_ptr(),
        qzeros.data_ptr(),
        scales.data_ptr(),
        y.data_ptr(),
        index,
        _current_stream(index),
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _decode_sized(x: torch.Tensor) -> bool:
    """Whether a call on ``x (..., K)`` has at most :data:`TILED_MAX_M` rows (the tiled GEMV's)."""
    return x.numel() <= TILED_MAX_M * x.shape[-1]


def _decode_tiles(
    x: torch.Tensor, qweight: torch.Tensor, group_size: int, cache: dict
) -> torch.Tensor | None:
    """The cached tile-layout codes for a decode-sized CUDA call, made on first use (outside
    graph capture) and remade when ``qweight`` is replaced or modified in place; ``None``
    where the call goes to the GEMM."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    if not TILED_DECODE or not _decode_sized(x) or not tiled_ok(k, n, group_size):
        return None
    if qweight.device != x.device:
        return None  # let the GEMM path name the device mismatch
    return _current_tiles(qweight, cache)


def _current_tiles(qweight: torch.Tensor, cache: dict) -> torch.Tensor | None:
    """``cache["tiled"]``'s copy of ``qweight`` (:func:`forge.tile_awq`), made where missing or
    made from another tensor or version (``qweight`` replaced, or changed in place); ``None``
    where it would be made during CUDA-graph capture. The copy is marked a static address, so
    that a CUDA graph recorded by ``torch.compile`` (``mode="reduce-overhead"``) reads it in
    place instead of copying it in at every replay."""
    key = (qweight.device, qweight.data_ptr(), qweight._version)
    entry = cache.get("tiled")
    if entry is not None and entry[0] == key:
        return entry[1]
    if qweight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    tiles = tile_awq(qweight)
    torch._dynamo.mark_static_address(tiles)
    cache["tiled"] = (key, tiles)
    return tiles


def prepare_decode(model: nn.Module) -> int:
    """Makes the tile-layout copy of every CUDA :class:`AwqLinear` in ``model`` now (the copy
    its decode-sized calls read, see :data:`TILED_DECODE`), instead of at its first
    decode-sized eager call: a ``torch.compile``'d decode step (transformers' ``generate``
    with a static cache compiles them, after an eager prefill of many rows) runs the tiled
    GEMV only with a copy made before compiling. A compiled step does not check the copy
    against ``qweight``: :meth:`AwqLinear.load_state_dict` drops it (so the step recompiles
    without it), and after any other in-place change of ``qweight`` call this again. Returns
    the bytes of GPU memory added (0 with :data:`TILED_DECODE` off, or where every copy is
    already current)."""
    added = 0
    if not TILED_DECODE:
        return added
    for mod in model.modules():
        if not isinstance(mod, AwqLinear) or not mod.qweight.is_cuda:
            continue
        if not tiled_ok(mod.in_features, mod.out_features, mod.group_size):
            continue
        before = mod._cache.get("tiled")
        tiles = _current_tiles(mod.qweight, mod._cache)
        if tiles is not None and (before is None or before[1] is not tiles):
            added += tiles.nbytes
    return added


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("forge::awq_gemm", mutates_args=())
def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    tiles: Optional[torch.Tensor] = None,  # noqa: UP045 - the op's schema is inferred from it
) -> torch.Tensor:
    """``x (..., K) @ dequant(W).T`` with forge's kernel (CUDA) or reference (CPU); ``x``'s dtype.
    With ``tiles`` (:func:`forge.tile_awq` of ``qweight``), CUDA calls of at most
    :data:`TILED_MAX_M` rows run the tiled GEMV on it (decided per call, so a traced graph
    with symbolic rows keeps both paths)."""
    if x.is_cuda:
        if tiles is not None and _decode_sized(x):
            return _cuda_gemv_tiled(x, qweight, tiles, qzeros, scales, group_size)
        return _cuda_gemm(x, qweight, qzeros, scales, group_size)
    return awq_matmul(x, qweight, qzeros, scales, group_size)


@awq_gemm.register_fake
def _awq_gemm_fake(x, qweight, qzeros, scales, group_size, tiles=None):
    return x.new_empty((*x.shape[:-1], scales.shape[-1]))


# --------------------------------------------------------------------------- grouped MoE GEMV

#: Most (token, expert) pairs for which :class:`AwqExperts` runs its quantized projections
#: through the grouped GEMV on CUDA (one launch per projection, no host sync, CUDA-graph
#: safe) instead of one GEMM per active expert after reading the per-expert counts back.
#: 384 covers decode up to batch 48 at top-8 (batch 64 at top-6): on an H100, one
#: DeepSeek-V3-like layer (64 experts of 1408, hidden 2048) at 64 tokens x top-6 took 789 µs
#: eager against 14736 µs for the loop (``benches/results-h100-runtime-moe.json``). The SIMT
#: kernel reads each active expert's weights once per segment of up to 4 rows, so it loses
#: to per-expert tensor-core GEMMs only once experts get many rows each (prefill).
GROUPED_MAX_PAIRS = 384
#: On CUDA, :class:`AwqExperts` runs each quantized projection as one launch of the grouped form
#: on tensor cores (a segment of up to 16 / 32 / 64 / 128 / 256 rows of one expert a block; see
#: :func:`moe_tc_rows`) once a call has more than :data:`GROUPED_TC_MIN_SHARE` pairs per expert:
#: nothing read back at any size, so prefill captures into CUDA graphs too. On an sm_90 GPU it is
#: the wgmma GEMM (up to 256 rows) for the shapes that take it, elsewhere (sm_80 and later, or
#: other shapes) the mma.sync GEMM (up to 64 rows; :func:`grouped_tc_max_rows`). On an H200
#: (``benches/results-h200-runtime-moe.json``, 64 experts of 1408, hidden 2048, top-6, in a CUDA
#: graph) the wgmma form ties the SIMT GEMV at 96 pairs (170 against 163 µs), wins from 192 (198
#: against 243 µs; 200 against 384 at 384 pairs), and from 1024 tokens on is, eager against
#: eager, 1.12-1.27x the bf16 layer as two ``torch._grouped_mm`` calls and 2.7-18x the
#: per-expert loop. At DeepSeek-V3's dimensions (256 experts of 2048, hidden 7168, top-8) the
#: crossover is the same (512 pairs: 2945 against 2858 µs; 2048 pairs: 3468 against 8725), and
#: from 256 tokens it is 1.22-2.18x ``_grouped_mm``. The mma.sync form, timed on the same H200
#: with ``FORGE_GEMM_WG=0``, hands over from the SIMT GEMV at the same share and from 256 tokens
#: is 2.8-51x the loop (64 experts) and 2.2-21x (DeepSeek-V3 dims). False: the SIMT GEMV up to
#: :data:`GROUPED_MAX_PAIRS`, the loop past it.
GROUPED_TC = True
#: Pairs per expert (on average) past which the tensor-core form takes over from the SIMT GEMV.
GROUPED_TC_MIN_SHARE = 2
#: When the tensor-core form takes its widest segments, 256 rows (the wgmma GEMM's m64n256 tile,
#: one block an SM): pairs (pairs an expert on average, mean in features of the layer's two
#: projections), of which the layer must reach both numbers of one; else 128 rows at most. Its
#: K is not split, so a lone block an SM pays off only for enough rows and long enough K, and
#: fewer rows need longer K. On an H200, 256 against 128 rows over 63 measured rows of 15 layer
#: shapes, uniform and skewed routing (crates/forge-cuda/LOG.md, "A 256-token tile" and
#: "Session 48"): these pairs take every gain of 3 % or more and no loss. Past 512 pairs an
#: expert, DBRX-like experts (mean in features 8448) run 1.14-1.19x and Qwen3-235B-like ones
#: (2816) 1.02-1.08x; ERNIE-4.5-21B-like ones (2048) run 0.96 / 1.04 / 1.06x at 512 / 1024 /
#: 2048 pairs an expert, OLMoE-like ones (1536) 0.98 / 1.02 / 1.05x at 1024 / 2048 / 4096; at
#: 256 every shape runs 0.84-1.02x.
GROUPED_TC_WIDE = ((512, 2560), (1024, 2048), (2048, 1536))
#: The tensor-core form's rows per segment (its token tiles: ``forge_cuda::ops::GROUPED_TC_ROWS``).
GROUPED_TC_ROWS = tuple(_native.GROUPED_TC_ROWS)
# (device, N, K, G) -> the most rows per segment of the tensor-core form there (0: none)
_GROUPED_TC_MAX_ROWS: dict[tuple[int, int, int, int], int] = {}
# split-K scratch bytes per (device, rows, pairs, segments, N, K, G)
_GROUPED_WORKSPACE: dict[tuple[int, ...], int] = {}


def moe_rows(tokens: int, pairs: int, num_experts: int) -> int:
    """Most rows per segment (the grouped kernel's variant): 1 for one token (its top-k
    experts are distinct), 2 while pairs are sparse over the experts, else 4."""
    if tokens == 1:
        return 1
    return 2 if pairs <= 2 * num_experts else 4


def moe_tc_rows(pairs: int, num_experts: int, max_rows: int, mean_in_features: int) -> int:
    """Rows per segment of the grouped tensor-core form for ``pairs`` pairs over
    ``num_experts`` experts, at most ``max_rows`` (:func:`grouped_tc_max_rows`): the smallest
    token tile that holds an expert's average share, so that most experts are one block row and
    the MMAs are no wider than they need. 256 rows only where the share and
    ``mean_in_features`` (of the layer's two projections) reach one pair of
    :data:`GROUPED_TC_WIDE`."""
    share = -(-pairs // max(num_experts, 1))
    if not any(share >= s and mean_in_features >= k for s, k in GROUPED_TC_WIDE):
        max_rows = min(max_rows, GROUPED_TC_ROWS[-2])  # all but the widest tile
    tiles = [r for r in GROUPED_TC_ROWS if r <= max_rows]
    if not tiles:
        raise ValueError(
            f"max_rows {max_rows}: the smallest tile of the tensor-core form is {GROUPED_TC_ROWS[0]}"
        )
    return next((r for r in tiles if r >= share), tiles[-1])


@torch.compiler.assume_constant_result
def grouped_tc_max_rows(dev: torch.device, in_features: int, out_features: int, group_size: int) -> int:
    """The most rows per segment with which the grouped form runs on tensor cores for these
    experts on CUDA device ``dev``: 256 on an sm_90 GPU where the wgmma GEMM takes the shape
    (out features a multiple of 128, in features and group of 64), 64 where the mma.sync GEMM
    does (sm_80 and later, out features and group multiples of 32), else 0. A constant of the
    device and shape: ``torch.compile`` calls it once while tracing."""
    index = _device_index(dev)
    key = (index, out_features, in_features, group_size)
    rows = _GROUPED_TC_MAX_ROWS.get(key)
    if rows is None:
        rows = _GROUPED_TC_MAX_ROWS[key] = _native.grouped_tc_max_rows(
            index, out_features, in_features, group_size
        )
    return rows


@torch.compiler.assume_constant_result
def grouped_gemv_shape_ok(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether the grouped GEMV (1, 2 or 4 rows a segment, :func:`moe_rows`) takes experts
    of these features and group size: a power-of-two group of at least 32, whole groups of in
    features, out features a multiple of 32. The rule its launch checks, asked of the native
    layer; a constant of the shape (``torch.compile`` calls it once while tracing)."""
    return _native.grouped_gemv_shape_ok(out_features, in_features, group_size)


def moe_max_segments(pairs: int, num_experts: int, rows: int) -> int:
    """Upper bound on the segments of ``pairs`` pairs over ``num_experts`` experts plus the
    invalid-id bucket, in runs of at most ``rows``: sum_b ceil(c_b / rows) over the
    non-empty buckets, at most (pairs + nonempty * (rows - 1)) // rows and at most pairs.
    Plain integer math, so that torch.compile traces it on symbolic sizes; the CUDA routing
    kernel's launch checks the table against the same bound (``_native.moe_max_segments``)."""
    nonempty = min(num_experts + 1, pairs)
    return max(1, min(pairs, (pairs + nonempty * (rows - 1)) // rows))


def moe_segments(top_k_index: torch.Tensor, num_experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts the (token, expert) pairs of ``top_k_index (T, k)`` by expert and cuts each
    expert's run into segments of at most ``rows`` pairs, with torch ops of static shapes
    only (no ``.tolist()`` / ``.item()``: nothing waits for the GPU, CUDA graphs capture it).

    Returns ``order`` (int32 ``[T*k]``: the pair index ``t*k + j`` at each sorted position;
    stable, so pairs of one expert keep token order) and ``segments`` (int32
    ``[moe_max_segments(T*k, E, rows), 3]``: first sorted position, row count, expert id;
    rows past the real segments are zeros, i.e. count 0). Ids outside ``[0, E)``
    (expert-parallel masking) are gathered under expert id ``E``, which the kernel answers
    with zeros.
    """
    ids = top_k_index.reshape(-1).to(torch.int64)
    pairs, e, dev = ids.numel(), num_experts, ids.device
    ids = torch.where((ids >= 0) & (ids < e), ids, e)
    order = torch.argsort(ids, stable=True)
    sid = ids[order]
    buckets = torch.arange(e + 1, device=dev, dtype=torch.int64)
    start = torch.searchsorted(sid, buckets)  # first sorted position of each expert
    end = torch.searchsorted(sid, buckets, right=True)
    pos = torch.arange(pairs, device=dev, dtype=torch.int64)
    head = (pos - start[sid]) % rows == 0  # a segment starts every `rows` pairs of a run
    count = torch.clamp(end[sid] - pos, max=rows)
    nseg = moe_max_segments(pairs, e, rows)
    # non-heads all land on the spare last row, which is dropped
    slot = torch.where(head, torch.cumsum(head, 0) - 1, nseg)
    table = torch.zeros(nseg + 1, 3, dtype=torch.int32, device=dev)
    table[slot] = torch.stack((pos, count, sid), dim=1).to(torch.int32)
    return order.to(torch.int32), table[:nseg]


#: Router id types the routing and combine kernels read.
_ID_DTYPES = (torch.int64, torch.int32)


def moe_route(
    top_k_index: torch.Tensor, num_experts: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_segments` plus each sorted pair's token (``order // k``): ``(order, tokens,
    segments)``. On CUDA (within ``MOE_ROUTE_MAX_PAIRS`` pairs and ``MOE_ROUTE_MAX_EXPERTS``
    experts) one kernel launch of one block builds all three (bit-identical to the torch ops,
    which a decode step would otherwise spend ~20 small kernels on); elsewhere the torch ops.
    ``torch.compile`` traces it as the custom op ``forge::moe_route``."""
    if torch.compiler.is_compiling():
        return torch.ops.forge.moe_route(top_k_index, num_experts, rows)
    return _moe_route(top_k_index, num_experts, rows)


def _moe_route(
    top_k_index: torch.Tensor, num_experts: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = top_k_index.shape[-1] if top_k_index.dim() else 1
    pairs = top_k_index.numel()
    if (
        top_k_index.is_cuda
        and top_k_index.dtype in _ID_DTYPES
        and 0 < pairs <= _native.MOE_ROUTE_MAX_PAIRS
        and 0 < num_experts <= _native.MOE_ROUTE_MAX_EXPERTS
        and rows >= 1
    ):
        dev = top_k_index.device
        ids = top_k_index.contiguous()
        nseg = moe_max_segments(pairs, num_experts, rows)
        order = torch.empty(pairs, dtype=torch.int32, device=dev)
        tokens = torch.empty(pairs, dtype=torch.int32, device=dev)
        segments = torch.empty(nseg, 3, dtype=torch.int32, device=dev)
        index = _device_index(dev)
        _native.moe_route_launch(
            ids.data_ptr(),
            ids.dtype == torch.int64,
            pairs,
            k,
            num_experts,
            rows,
            order.data_ptr(),
            tokens.data_ptr(),
            segments.data_ptr(),
            nseg,
            index,
            _current_stream(index),
        )
        return order, tokens, segments
    order, segments = moe_segments(top_k_index, num_experts, rows)
    return order, torch.div(order, k, rounding_mode="floor"), segments


@torch.library.custom_op("forge::moe_route", mutates_args=())
def _moe_route_op(
    top_k_index: torch.Tensor, num_experts: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _moe_route(top_k_index, num_experts, rows)


@_moe_route_op.register_fake
def _(top_k_index, num_experts, rows):
    pairs = top_k_index.numel()
    nseg = moe_max_segments(pairs, num_experts, rows)
    i32 = {"dtype": torch.int32}
    return (
        top_k_index.new_empty(pairs, **i32),
        top_k_index.new_empty(pairs, **i32),
        top_k_index.new_empty((nseg, 3), **i32),
    )


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def moe_combine(
    y: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The top-k weighted sum of per-pair expert outputs: ``out[t] = sum_j w[t, j] * y[t*k + j]``
    for ``y (T*k, H)``, in float32, in ``y``'s dtype; a pair whose id is outside
    ``[0, num_experts)`` adds nothing whatever its weight. On CUDA (16-bit ``y``, ``H % 8 ==
    0``) one kernel launch; elsewhere the torch ops. ``torch.compile`` traces it as the custom
    op ``forge::moe_combine``."""
    if torch.compiler.is_compiling():
        return torch.ops.forge.moe_combine(y, top_k_weights, top_k_index, num_experts)
    return _moe_combine(y, top_k_weights, top_k_index, num_experts)


def _moe_combine(
    y: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    t, k = top_k_index.shape
    h = y.shape[-1]
    if (
        y.is_cuda
        and y.dtype in _GEMM_DTYPES
        and top_k_weights.dtype in _WEIGHT_DTYPES
        and top_k_index.dtype in _ID_DTYPES
        and h % 8 == 0
        and 0 < t <= _native.MOE_COMBINE_MAX_TOKENS
        and y.shape == (t * k, h)
    ):
        ya, wa, ids = y.contiguous(), top_k_weights.contiguous(), top_k_index.contiguous()
        out = torch.empty((t, h), dtype=y.dtype, device=y.device)
        index = _device_index(y.device)
        _native.moe_combine_launch(
            ya.data_ptr(),
            ya.dtype == torch.bfloat16,
            wa.data_ptr(),
            str(wa.dtype),
            ids.data_ptr(),
            ids.dtype == torch.int64,
            t,
            k,
            h,
            num_experts,
            out.data_ptr(),
            index,
            _current_stream(index),
        )
        return out
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    w = torch.where(valid, top_k_weights.float(), 0.0)  # masked ids add nothing, whatever their weight
    return (y.view(t, k, h).float() * w[..., None]).sum(1).to(y.dtype)


@torch.library.custom_op("forge::moe_combine", mutates_args=())
def _moe_combine_op(
    y: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    return _moe_combine(y, top_k_weights, top_k_index, num_experts)


@_moe_combine_op.register_fake
def _(y, top_k_weights, top_k_index, num_experts):
    return y.new_empty((top_k_index.shape[0], y.shape[-1]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up (..., 2I)``, a row's ``I`` gate columns then its ``I`` up
    columns (the experts' gate_up projection), in its dtype, each step rounded as the two torch
    ops round it (``silu`` to the dtype, then the product). On CUDA (16-bit, ``I % 8 == 0``,
    contiguous and 16-byte aligned) one kernel launch instead of torch's two and their
    intermediate; elsewhere, and while ``torch.compile`` traces (it fuses the two itself), the
    torch ops."""
    i2 = gate_up.shape[-1]
    if (
        not torch.compiler.is_compiling()
        and gate_up.is_cuda
        and gate_up.dtype in _GEMM_DTYPES
        and i2 % 16 == 0
        and gate_up.numel() > 0
        and gate_up.is_contiguous()
        and gate_up.data_ptr() % 16 == 0
    ):
        out = gate_up.new_empty((*gate_up.shape[:-1], i2 // 2))
        index = _device_index(gate_up.device)
        _native.silu_mul_launch(
            gate_up.data_ptr(),
            gate_up.dtype == torch.bfloat16,
            gate_up.numel() // i2,
            i2 // 2,
            out.data_ptr(),
            index,
            _current_stream(index),
        )
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _cuda_moe_gemv(
    x: torch.Tensor,
    x_rows: torch.Tensor,
    out_rows: torch.Tensor,
    segments: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    rows: int,
) -> torch.Tensor:
    """The grouped GEMV on CUDA (see :func:`awq_moe_gemv`): one launch (plus the split-K
    sum) on the current stream, output and scratch from torch's allocator, no host sync."""
    dev = x.device
    e, k, n = _check_device_awq(qweight, qzeros, scales, group_size, dev, stacked=True)
    for name, t in (("x_rows", x_rows), ("out_rows", out_rows), ("segments", segments)):
        if t.device != dev or t.dtype != torch.int32:
            raise DTypeError(f"{name}: expected int32 on {dev}, got {t.dtype} on {t.device}")
    pairs, nseg = out_rows.numel(), segments.shape[0]
    if x.dim() != 2 or x.shape[-1] != k:
        raise ShapeError(f"x: expected (rows, {k}), got {tuple(x.shape)}")
    if x_rows.shape != (pairs,) or out_rows.shape != (pairs,) or tuple(segments.shape) != (nseg, 3):
        raise ShapeError(
            f"x_rows {tuple(x_rows.shape)} and out_rows {tuple(out_rows.shape)} must be (pairs,), "
            f"segments {tuple(segments.shape)} (S, 3)"
        )
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    x_rows, out_rows, segments = x_rows.contiguous(), out_rows.contiguous(), segments.contiguous()
    xa = (x if x.dtype in _GEMM_DTYPES else x.to(torch.float16)).contiguous()
    y = torch.empty((pairs, n), dtype=xa.dtype, device=dev)
    if pairs == 0 or nseg == 0:
        return y.to(x.dtype)
    index = _device_index(dev)
    key = (index, rows, pairs, nseg, n, k, group_size)
    ws_bytes = _GROUPED_WORKSPACE.get(key)
    if ws_bytes is None:
        ws_bytes = _GROUPED_WORKSPACE[key] = _native.w4a16_grouped_workspace_bytes(
            index, rows, pairs, nseg, n, k, group_size
        )
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    ng = k // group_size
    _native.w4a16_grouped_launch(
        xa.data_ptr(),
        xa.dtype == torch.bfloat16,
        x_rows.data_ptr(),
        out_rows.data_ptr(),
        pairs,
        segments.data_ptr(),
        nseg,
        rows,
        e,
        k,
        n,
        group_size,
        qweight.data_ptr(),
        qzeros.data_ptr(),
        scales.data_ptr(),
        [k * n // PACK, ng * n // PACK, ng * n],
        y.data_ptr(),
        0 if ws is None else ws.data_ptr(),
        ws_bytes,
        index,
        _current_stream(index),
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _moe_gemv_reference(x, x_rows, out_rows, segments, qweight, qzeros, scales, group_size, rows):
    """What the grouped kernel computes, segment by segment (any device; reads the table back)."""
    e = qweight.shape[0]
    y = torch.zeros((out_rows.numel(), scales.shape[-1]), dtype=x.dtype, device=x.device)
    for first, count, ex in segments.tolist():
        count = min(count, rows)
        if count <= 0 or not 0 <= ex < e:
            continue  # past the real segments / masked id: zeros
        pos = slice(first, first + count)
        xs = x.index_select(0, x_rows[pos].long())
        ys = awq_matmul(xs, qweight[ex], qzeros[ex], scales[ex], group_size)
        y[out_rows[pos].long()] = ys.to(x.dtype)
    return y


@torch.library.custom_op("forge::awq_moe_gemv", mutates_args=())
def awq_moe_gemv(
    x: torch.Tensor,
    x_rows: torch.Tensor,
    out_rows: torch.Tensor,
    segments: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    rows: int,
) -> torch.Tensor:
    """Grouped W4A16 GEMV over stacked AWQ experts (``qweight [E, K, N/8]`` etc.): for each
    segment ``(first, count, e)`` of ``segments`` (see :func:`moe_segments`) and each sorted
    position ``p`` in ``first .. first + min(count, rows)``,
    ``y[out_rows[p]] = x[x_rows[p]] @ dequant(W_e).T``; ids outside ``[0, E)`` give zeros.
    Returns ``y (pairs = out_rows.numel(), N)`` in ``x``'s dtype. CUDA: one kernel launch
    (forge's SIMT GEMV for ``rows`` in {1, 2, 4}; a tensor-core GEMM, a segment a block, for
    ``rows`` in :data:`GROUPED_TC_ROWS` up to :func:`grouped_tc_max_rows`); elsewhere a segment
    loop (reference)."""
    if x.is_cuda:
        return _cuda_moe_gemv(x, x_rows, out_rows, segments, qweight, qzeros, scales, group_size, rows)
    return _moe_gemv_reference(x, x_rows, out_rows, segments, qweight, qzeros, scales, group_size, rows)


@awq_moe_gemv.register_fake
def _awq_moe_gemv_fake(x, x_rows, out_rows, segments, qweight, qzeros, scales, group_size, rows):
    return x.new_empty((out_rows.shape[0], scales.shape[-1]))


# --------------------------------------------------------------------------- CPU int4 path

_CPU_DTYPES = (torch.bfloat16, torch.float16)
_CPU_GROUPS = (32, 64, 128, 256)


def cpu_int4_supported(in_features: int, out_features: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether the CPU path uses ``aten._weight_int4pack_mm_for_cpu`` for this shape and dtype."""
    return (
        hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and dtype in _CPU_DTYPES
        and group_size in _CPU_GROUPS
        and in_features % group_size == 0
        and out_features % 16 == 0
        and in_features % 16 == 0
    )


def _to_int4pack_cpu(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ tensors -> (tinygemm packed weight uint8 ``[N, K/2]``, scales_and_zeros ``[K/G, N, 2]``)."""
    codes, zeros = unpack_awq(qweight, qzeros, group_size)  # (K, N), (K/G, N) uint8
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.t().contiguous().to(torch.int32), 1)
    s = scales.to(torch.float32)
    zero_bias = (8.0 - zeros.to(torch.float32)) * s
    return packed, torch.stack([s, zero_bias], dim=-1).to(dtype).contiguous()


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    cache: dict | None = None,
    decode_tiles: bool = True,
) -> torch.Tensor:
    """``x (..., K) @ dequant(W).T + bias`` in ``x``'s dtype, on ``x``'s device.

    ``cache`` (a dict owned by the caller) keeps the CPU int4pack form (or the dense fallback
    weight), and on CUDA the tile-layout codes for decode-sized calls (unless
    ``decode_tiles`` is false, or :data:`TILED_DECODE`), between calls; each is rebuilt when a
    buffer is modified in place (``load_state_dict``) or the dtype changes.
    """
    k, n = qweight.shape[0], scales.shape[-1]
    if x.shape[-1] != k:
        raise ShapeError(f"x: expected last dim {k} (in_features), got {tuple(x.shape)}")
    if torch.compiler.is_compiling():
        # the copy made before compiling (not remade here: AwqLinear drops it on load_state_dict)
        entry = cache.get("tiled") if cache is not None and decode_tiles and TILED_DECODE else None
        y = torch.ops.forge.awq_gemm(
            x, qweight, qzeros, scales, group_size, None if entry is None else entry[1]
        )
    elif x.is_cuda:
        tiles = None if cache is None or not decode_tiles else _decode_tiles(x, qweight, group_size, cache)
        if tiles is not None:
            y = _cuda_gemv_tiled(x, qweight, tiles, qzeros, scales, group_size)
        else:
            y = _cuda_gemm(x, qweight, qzeros, scales, group_size)
    elif x.device.type != "cpu":
        y = torch.ops.forge.awq_gemm(x, qweight, qzeros, scales, group_size)
    elif cpu_int4_supported(k, n, group_size, x.dtype):
        key = (x.dtype, qweight.data_ptr(), qweight._version, qzeros._version, scales._version)
        entry = None if cache is None else cache.get("int4pack")
        if entry is None or entry[0] != key:
            entry = (key, *_to_int4pack_cpu(qweight, qzeros, scales, group_size, x.dtype))
            if cache is not None:
                cache["int4pack"] = entry
        x2 = x.reshape(-1, k).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, entry[1], group_size, entry[2])
        y = y.reshape(*x.shape[:-1], n)
    else:
        key = (x.dtype, qweight.data_ptr(), qweight._version, qzeros._version, scales._version)
        entry = None if cache is None else cache.get("dense")
        if entry is None or entry[0] != key:
            entry = (key, dequantize_awq(qweight, qzeros, scales, group_size).to(x.dtype))
            if cache is not None:
                cache["dense"] = entry
        y = nn.functional.linear(x, entry[1])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _check_awq(name: str, qweight, qzeros, scales, group_size: int, k: int, n: int) -> None:
    """Validates one AWQ triple against ``in_features = k``, ``out_features = n``."""
    if group_size % 32 or not 32 <= group_size <= 1024:
        raise ShapeError(f"{name}: group_size must be a multiple of 32 in [32, 1024], got {group_size}")
    if n % PACK or k % group_size:
        raise ShapeError(
            f"{name}: in_features {k} must be a multiple of group_size {group_size} "
            f"and out_features {n} of {PACK}"
        )
    want = {
        "qweight": ((k, n // PACK), torch.int32),
        "qzeros": ((k // group_size, n // PACK), torch.int32),
        "scales": ((k // group_size, n), torch.float16),
    }
    for part, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        shape, dtype = want[part]
        if tuple(t.shape[-2:]) != shape:
            raise ShapeError(f"{name}.{part}: expected shape {shape}, got {tuple(t.shape)}")
        if t.dtype != dtype and not t.is_meta:
            raise DTypeError(f"{name}.{part}: expected {dtype}, got {t.dtype}")


# --------------------------------------------------------------------------- modules


class AwqLinear(nn.Module):
    """``nn.Linear`` replacement holding a vLLM AWQ "gemm" weight (buffers, not parameters)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int = 128,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        _check_awq(
            "AwqLinear",
            *_empty_awq(in_features, out_features, group_size),
            group_size,
            in_features,
            out_features,
        )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        ng = in_features // group_size
        self.register_buffer(
            "qweight", torch.zeros(in_features, out_features // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer(
            "qzeros", torch.zeros(ng, out_features // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.zeros(ng, out_features, dtype=torch.float16, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self._cache: dict = {}

    @classmethod
    def from_tensors(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        name: str = "AwqLinear",
    ) -> AwqLinear:
        """Wraps existing AWQ tensors (no copy); ``name`` is used in error messages."""
        k, n = qweight.shape[0], scales.shape[-1]
        _check_awq(name, qweight, qzeros, scales, group_size, k, n)
        if bias is not None and tuple(bias.shape) != (n,):
            raise ShapeError(f"{name}.bias: expected shape ({n},), got {tuple(bias.shape)}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features, mod.group_size = k, n, group_size
        mod.register_buffer("qweight", qweight)
        mod.register_buffer("qzeros", qzeros)
        mod.register_buffer("scales", scales)
        if bias is not None:
            mod.register_buffer("bias", bias)
        else:
            mod.bias = None
        mod._cache = {}
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return awq_linear(x, self.qweight, self.qzeros, self.scales, self.group_size, self.bias, self._cache)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        # copies made from the old tensors (the int4pack, the tile layout) are stale now; a
        # compiled forward that read the tile copy recompiles on its absence (a dict guard)
        super()._load_from_state_dict(*args, **kwargs)
        self._cache.clear()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


def _act_fn(name: str):
    try:
        from transformers.activations import ACT2FN

        return ACT2FN[name]
    except (ImportError, KeyError):
        if name in ("silu", "swish"):
            return nn.functional.silu
        raise


class AwqExperts(nn.Module):
    """Grouped MoE experts (``act(gate(x)) * up(x)`` then ``down``) over stacked AWQ tensors.

    A drop-in for transformers 5's fused experts modules (``DeepseekV3NaiveMoe``,
    ``Qwen3MoeExperts``, ``MixtralExperts``): ``forward(hidden_states (T, H), top_k_index
    (T, k), top_k_weights (T, k)) -> (T, H)``. Gate and up are concatenated along N (one
    ``[E, H, 2I/8]`` weight, gate columns first, as transformers' ``gate_up_proj``). Either
    projection may instead be dense (``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
    parameters, transformers' layout) when the checkpoint kept it unquantized. Only experts
    that receive tokens run; ids outside ``[0, E)`` are ignored (expert-parallel masking).

    On CUDA, with both projections quantized (power-of-two group, out-features multiples of
    32) and at most :data:`GROUPED_MAX_PAIRS` pairs, gate_up and down are one grouped GEMV
    launch each (gate_up reads the hidden rows of its pairs in place, outputs are per pair)
    and the top-k sum is taken in float32: no host sync, so CUDA graphs and
    ``torch.compile(fullgraph=True)`` capture it. With more than
    :data:`GROUPED_TC_MIN_SHARE` pairs per expert (batched decode, prefill: any size), the
    same two launches run the grouped form on tensor cores (:data:`GROUPED_TC`: the wgmma GEMM
    on an sm_90 GPU, the mma.sync GEMM on other GPUs from sm_80), where both projections'
    shapes allow it. Otherwise (dense projections, older GPUs and shapes past
    :data:`GROUPED_MAX_PAIRS`, CPU) the experts run one by one after the per-expert counts
    are read back.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        group_size: int = 128,
        hidden_act: str = "silu",
        quantized_gate_up: bool = True,
        quantized_down: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        e, h, i, g = num_experts, hidden_size, intermediate_size, group_size
        self.num_experts, self.hidden_dim, self.intermediate_dim, self.group_size = e, h, i, g
        self.hidden_act = hidden_act
        self.act_fn = _act_fn(hidden_act)
        self._silu = hidden_act in ("silu", "swish")  # silu_mul: one launch for act(gate) * up
        self.quantized_gate_up, self.quantized_down = quantized_gate_up, quantized_down
        if quantized_gate_up:
            _check_awq("AwqExperts.gate_up", *_empty_awq(h, 2 * i, g), g, h, 2 * i)
            for part, t in zip(
                ("qweight", "qzeros", "scales"), _empty_awq(h, 2 * i, g, e, device), strict=True
            ):
                self.register_buffer(f"gate_up_{part}", t)
        else:
            self.gate_up_proj = nn.Parameter(
                torch.zeros(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False
            )
        if quantized_down:
            _check_awq("AwqExperts.down", *_empty_awq(i, h, g), g, i, h)
            for part, t in zip(("qweight", "qzeros", "scales"), _empty_awq(i, h, g, e, device), strict=True):
                self.register_buffer(f"down_{part}", t)
        else:
            self.down_proj = nn.Parameter(
                torch.zeros(e, h, i, dtype=dtype, device=device), requires_grad=False
            )
        self._caches: dict = {}

    def _proj(self, which: str, x: torch.Tensor, e: int) -> torch.Tensor:
        if not getattr(self, f"quantized_{which}"):
            return nn.functional.linear(x, getattr(self, f"{which}_proj")[e].to(x.dtype))
        cache = self._caches.setdefault((which, e), {})
        # No tile-layout copies of experts: the per-expert path runs prefill, where most
        # experts see few tokens, and a copy each would double the experts' memory (decode
        # takes the grouped GEMV on the AWQ tensors).
        return awq_linear(
            x,
            getattr(self, f"{which}_qweight")[e],
            getattr(self, f"{which}_qzeros")[e],
            getattr(self, f"{which}_scales")[e],
            self.group_size,
            cache=cache,
            decode_tiles=False,
        )

    def _grouped_rows(self, hidden_states: torch.Tensor, pairs: int) -> int | None:
        """Rows per segment of the grouped launches for this call, or None for the per-expert
        loop: the tensor-core form's (:func:`moe_tc_rows`, up to what
        :func:`grouped_tc_max_rows` allows for both projections) past
        :data:`GROUPED_TC_MIN_SHARE` pairs per expert, else the SIMT GEMV's (:func:`moe_rows`)
        up to :data:`GROUPED_MAX_PAIRS` pairs where it takes both projections
        (:func:`grouped_gemv_shape_ok`). Both projections must be quantized."""
        if not (hidden_states.is_cuda and self.quantized_gate_up and self.quantized_down and pairs > 0):
            return None
        e, h, i, g = self.num_experts, self.hidden_dim, self.intermediate_dim, self.group_size
        if GROUPED_TC and pairs > GROUPED_TC_MIN_SHARE * e:
            dev = hidden_states.device
            max_rows = min(grouped_tc_max_rows(dev, h, 2 * i, g), grouped_tc_max_rows(dev, i, h, g))
            rows = moe_tc_rows(pairs, e, max_rows, (h + i) // 2) if max_rows else 0
            # (past ~8M pairs the segment table outgrows the launch's grid: the loop)
            if rows and moe_max_segments(pairs, e, rows) <= _native.GROUPED_MAX_SEGMENTS:
                return rows
        if (
            pairs <= GROUPED_MAX_PAIRS
            and grouped_gemv_shape_ok(h, 2 * i, g)
            and grouped_gemv_shape_ok(i, h, g)
        ):
            return moe_rows(hidden_states.shape[0], pairs, e)
        return None

    def _forward_grouped(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        rows: int,
    ) -> torch.Tensor:
        """Both projections through the grouped launches, segments of at most ``rows`` rows
        (:meth:`_grouped_rows`): two launches for all experts, the segment table built on the
        GPU, nothing read back (CUDA-graph safe)."""
        e, g = self.num_experts, self.group_size
        order, tokens, segments = moe_route(top_k_index, e, rows)  # tokens: of each sorted pair
        if hidden_states.is_cuda and not torch.compiler.is_compiling():
            gemv = _cuda_moe_gemv  # eager: no dispatcher round trip
        else:
            gemv = torch.ops.forge.awq_moe_gemv  # traced by torch.compile; the reference off CUDA
        gate_up = gemv(
            hidden_states,
            tokens,
            order,
            segments,
            self.gate_up_qweight,
            self.gate_up_qzeros,
            self.gate_up_scales,
            g,
            rows,
        )  # (T*k, 2I), row = pair
        y = gemv(
            self._act_mul(gate_up),
            order,
            order,
            segments,
            self.down_qweight,
            self.down_qzeros,
            self.down_scales,
            g,
            rows,
        )  # (T*k, H); masked pairs are zeros
        return moe_combine(y, top_k_weights, top_k_index, e).to(hidden_states.dtype)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the gate_up projection's output ``(rows, 2I)``."""
        if self._silu:
            return silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        rows = self._grouped_rows(hidden_states, top_k_index.numel())
        if rows is not None:
            return self._forward_grouped(hidden_states, top_k_index, top_k_weights, rows)
        # float32 accumulator: exact-er sums, and CPU index_add_ in bf16 is ~10x slower
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        valid = (flat >= 0) & (flat < self.num_experts)
        ids = torch.where(valid, flat, torch.full_like(flat, self.num_experts))
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        token_of = order // k
        weight_of = top_k_weights.reshape(-1)[order]
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            x = hidden_states.index_select(0, tokens)
            y = self._proj("down", self._act_mul(self._proj("gate_up", x, e)), e)
            y = y * weight_of[start : start + count, None]
            out.index_put_((tokens,), y.float(), accumulate=True)  # CPU index_add_ is ~100x slower
            start += count
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"group_size={self.group_size}, quantized_gate_up={self.quantized_gate_up}, "
            f"quantized_down={self.quantized_down}"
        )


def _empty_awq(k: int, n: int, g: int, e: int | None = None, device=None):
    lead = () if e is None else (e,)
    dev = "meta" if e is None else device
    ng = k // max(g, 1)
    return (
        torch.zeros(*lead, k, n // PACK, dtype=torch.int32, device=dev),
        torch.zeros(*lead, ng, n // PACK, dtype=torch.int32, device=dev),
        torch.zeros(*lead, ng, n, dtype=torch.float16, device=dev),
    )
