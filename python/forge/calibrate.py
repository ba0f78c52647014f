"""The calibrated GPTQ run: a layer-by-layer forward over calibration text that feeds GPTQ.

Data flow (one engine for GPTQ and router statistics):

* Rust (``forge._native.Session``) plans the checkpoint, prepares or resumes the output
  folder, hands out every source tensor as a zero-copy view of its memory map, packs and
  writes each quantized linear at its planned offset, and records finished units (with
  this module's resume state) in the manifest. It writes ``config.json`` last.
* This module owns the forward pass: the embeddings of all calibration windows are computed
  once; then each decoder layer is built from the model family's own transformers class
  (meta device, weights assigned from the views, FP8 dequantised on the compute device),
  run over the calibration hidden states with hooks that accumulate ``H = XᵀX`` (fp32) per
  linear, solved with GPTQ stage by stage (``true_sequential``), its dequantized weights
  swapped in, and run again to produce the next layer's inputs.
* Routed experts are handled expert-major: the MoE block's inputs, top-k ids and weights
  are collected for every calibration token, then each expert's gate/up share one Hessian
  over exactly its routed tokens, its down gets one over its own intermediate activations,
  and its quantized output (times the router weight) is summed into the layer's routed
  output. Experts with too few tokens fall back to a pooled Hessian or to RTN.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import _native
from .errors import CheckpointError, InvalidValueError, ShapeError
from .prune import kept_experts
from .quant import build_quant_grid, hessian_update, quantize_rtn
from .vllm_plugin import remap_routing

__all__ = ["run_layerwise", "load_calibration", "hessian_error"]

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


TAP: Callable[..., None] | None = None
"""Test seam: when set, called as ``TAP("layer_input", layer=i, hidden=[chunks])`` before each
layer and ``TAP("hessian", module=name, hessian=H, tokens=n)`` before each solve (H is
normalised by the token count)."""

ABORT_ENV = "FORGE_TEST_ABORT_AFTER_LAYERS"


class _Phases:
    """Seconds per phase of the run (CUDA synchronised at each boundary, so GPU time lands in
    the phase that queued it); nested phases are subtracted from their parent."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []

    def __call__(self, name: str):
        return _Phase(self, name)


class _Phase:
    def __init__(self, owner: _Phases, name: str):
        self.o, self.name = owner, name

    def __enter__(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        self.o._stack.append([self.name, 0.0])
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        _, inner = self.o._stack.pop()
        self.o.seconds[self.name] = self.o.seconds.get(self.name, 0.0) + dt - inner
        if self.o._stack:
            self.o._stack[-1][1] += dt
        return False


PHASES = _Phases()


def _tap(event: str, **data) -> None:
    if TAP is not None:
        TAP(event, **data)


class _StopForward(Exception):
    """Raised by a hook once everything a stage needs from a forward pass is captured."""


# --------------------------------------------------------------------------------------
# Calibration data


def load_calibration(
    path: str | os.PathLike, tokenizer, nsamples: int, seqlen: int, seed: int = 0
) -> torch.Tensor:
    """``(nsamples, seqlen)`` int64 token windows from a calibration file.

    Plain text (any extension), ``.jsonl`` (one object per line with a ``text`` field),
    or token ids: ``.json`` (a list of ints, or of lists) and ``.pt`` (an integer tensor,
    loaded with ``weights_only=True``). Windows start at seeded random offsets of the
    concatenated token stream (documents joined by the tokenizer's EOS token).
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidValueError(f"calib: {p} is not a file")
    suffix = p.suffix.lower()
    ids: list[int]
    if suffix == ".pt":
        t = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor) or t.is_floating_point():
            raise InvalidValueError(f"calib: {p} must hold an integer tensor of token ids")
        ids = t.flatten().tolist()
    elif suffix == ".json":
        try:
            v = json.loads(p.read_text())
        except ValueError as exc:
            raise InvalidValueError(f"calib: {p} is not valid JSON: {exc}") from exc
        flat = (
            [x for row in v for x in (row if isinstance(row, list) else [row])]
            if isinstance(v, list)
            else None
        )
        if not flat or not all(isinstance(x, int) for x in flat):
            raise InvalidValueError(f"calib: {p} must hold a list of token ids (ints, or lists of ints)")
        ids = flat
    else:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidValueError(f"calib: {p} is not UTF-8 text ({exc})") from exc
        if suffix == ".jsonl":
            docs = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise InvalidValueError(f"calib: {p} line {n} is not JSON: {exc}") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise InvalidValueError(f'calib: {p} line {n} has no string "text" field')
                docs.append(obj["text"])
        else:
            docs = [text]
        if tokenizer is None:
            raise CheckpointError("the model folder has no tokenizer; pass token ids (.json or .pt) as calib")
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = []
        for d in docs:
            if not d.strip():
                continue
            if ids and eos is not None:
                ids.append(int(eos))
            ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
    if len(ids) < seqlen:
        raise InvalidValueError(
            f"calib: {p} holds {len(ids)} tokens, fewer than one window of seqlen={seqlen}; "
            "give more text or a smaller seqlen"
        )
    stream = torch.tensor(ids, dtype=torch.int64)
    rng = random.Random(seed)
    starts = [rng.randint(0, len(ids) - seqlen) for _ in range(nsamples)]
    return torch.stack([stream[s : s + seqlen] for s in starts])


# --------------------------------------------------------------------------------------
# Hessians and the GPTQ step


def _error_sums(w: torch.Tensor, w_hats: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``[‖X(W−Ŵ₁)ᵀ‖², …, ‖XWᵀ‖²]`` from ``H = XᵀX`` (W is ``(N, K)``) on ``h``'s device, with
    no host sync: the products ``[W−Ŵ₁; …; W] · H`` as one matmul. On CUDA it runs in bf16 with
    fp32 accumulation (tensor cores; a report figure, good to ~3 significant digits), on the
    CPU in fp32."""
    w = w.float()
    a = torch.cat([w - wh.float() for wh in w_hats] + [w])
    if h.is_cuda:
        ah = torch.mm(a.to(torch.bfloat16), h.to(torch.bfloat16), out_dtype=torch.float32)
    else:
        ah = a @ h.float()
    return (ah * a).view(len(w_hats) + 1, w.shape[0], -1).sum((1, 2))


def _relative(sums: list[float]) -> list[float]:
    *num, den = sums
    return [x / den if den > 0 else 0.0 for x in num]


def hessian_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """Relative output error ``‖X(W−Ŵ)ᵀ‖² / ‖XWᵀ‖²`` from ``H = XᵀX`` (W is ``(N, K)``)."""
    return _relative(_error_sums(w, [w_hat], h).tolist())[0]


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32: on CUDA one GEMM with fp32 output (no rounding to ``a``'s dtype and
    no widening pass), on the CPU the float32 product of the same values."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


SYMMETRIC_ROWS = 16384
"""Rows from which :func:`gram` multiplies only the upper triangle. Below it one full product
is faster on an H100 (D=7168: 2048 rows 0.31 ms full against 0.59 ms for the upper blocks;
8192 rows 1.06 against 1.19); at 65536 rows the upper panels take 6.2 ms against 9.2."""


def gram(x: torch.Tensor) -> torch.Tensor:
    """``XᵀX (D, D)`` in float32 of ``x (T, D)``.

    bf16 CUDA inputs run on tensor cores with fp32 accumulation (bf16 products are exact in
    fp32, so this is the fp32 product of the same values). From ``SYMMETRIC_ROWS`` rows only the
    upper triangle is multiplied, one row panel of ``D / nb`` features at a time (panel ``i``
    against features ``e_i..D``: ``(nb + 1) / 2nb`` of the products, 5/8 for ``nb = 4``), and
    mirrored. Other inputs: one product with fp32 output (:func:`_mm_f32`).
    """
    t, d = x.shape
    if not (x.is_cuda and x.dtype == torch.bfloat16 and t >= SYMMETRIC_ROWS and d >= 1024):
        return _mm_f32(x.t(), x)
    nb = 8 if d >= 12288 else 4
    edges = [round(d * i / nb / 64) * 64 for i in range(nb)] + [d]
    h = torch.empty(d, d, dtype=torch.float32, device=x.device)
    for i in range(nb):
        a0, a1 = edges[i], edges[i + 1]
        panel = _mm_f32(x[:, a0:a1].t(), x[:, a0:])
        h[a0:a1, a0:] = panel
        if a1 < d:
            h[a1:, a0:a1] = panel[:, a1 - a0 :].t()
    return h


KERNEL_MIN_D = 4096
"""Inputs from which :func:`add_gram` takes forge's Hopper kernel below ``SYMMETRIC_ROWS`` rows.
On an H100 (``benches/bench_cuda.py --only hessian``, 2026-11-26) it adds in place what
``gram`` computes and a separate ``+=`` adds: D=16384 at 8192 rows 4.44 ms against 6.59 ms plus
~1.1 ms for the add; D=7168 0.93 against 1.06 + 0.2 (2048 rows: 0.40 against 0.31 + 0.2);
at D=2048 cuBLAS is faster (0.23 against 0.12 at 8192 rows), and from 16384 rows ``gram``'s
upper panels are (D=7168 at 65536 rows: 7.37 against 6.35)."""


def add_gram(h: torch.Tensor, x: torch.Tensor) -> None:
    """``h += XᵀX`` in float32 for ``x (T, D)``: forge's Hopper kernel in place (the upper tiles,
    mirrored: ``h`` stays exactly symmetric) when it is the kernel ``hessian_update`` runs for
    these tensors and ``D >= KERNEL_MIN_D`` with fewer than ``SYMMETRIC_ROWS`` rows, where it is
    the faster; else :func:`gram` added. Both sum the same exact products in fp32, in another
    order. The inputs are not scanned for NaN or Inf: :meth:`_Hessian.full` finds them on the
    diagonal."""
    t, d = x.shape
    if x.is_cuda and d >= KERNEL_MIN_D and t < SYMMETRIC_ROWS and _native.hessian_kernel(h, x) == "wgmma":
        hessian_update(h, x, 1.0, check_finite=False)
    else:
        h += gram(x)


def _all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN or Inf, from one float32 sum (one read of ``x``; ``isfinite``
    on bf16 runs three elementwise passes and a reduction). A sum beyond float32's range
    counts as non-finite: activations that large are broken too."""
    return bool(torch.isfinite(x.sum(dtype=torch.float32)))


class _Hessian:
    """``XᵀX`` in fp32 over the calibration tokens that reach one linear (full or block-diagonal)."""

    def __init__(self, k: int, device: torch.device, block: int | None):
        self.k, self.block, self.tokens = k, block, 0
        if block:
            self.h = torch.zeros(k // block, block, block, dtype=torch.float32, device=device)
        else:
            self.h = torch.zeros(k, k, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor) -> None:
        with PHASES("hessian"):
            self._add(x)

    def _add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        if x.shape[0] == 0:
            return
        self.tokens += x.shape[0]
        x = x.to(self.h.device)
        if self.block:
            xb = x.float().view(x.shape[0], self.k // self.block, self.block).transpose(0, 1)
            self.h.baddbmm_(xb.transpose(1, 2), xb)
        else:
            add_gram(self.h, x)

    def full(self) -> torch.Tensor:
        """The Hessian; refuses one whose inputs held NaN or Inf. That shows on its diagonal
        (``Σ x²`` of each input), so the inputs are not scanned at every ``add``: at 2M tokens
        the scans cost ~2 s per DeepSeek-V3 layer."""
        if not bool(torch.isfinite(self.h.diagonal(dim1=-2, dim2=-1)).all()):
            raise InvalidValueError(
                "calibration activations hold NaN or Inf (or values too large to square in float32)"
            )
        if not self.block:
            return self.h
        return torch.block_diag(*self.h.unbind(0))


@dataclass
class _Solved:
    codes: torch.Tensor
    qmeta: torch.Tensor
    deq: torch.Tensor
    info: dict
    grid: _Grid


def _grid_kw(opts: dict) -> dict:
    return dict(
        quant_max_shrink=opts["mse_shrink"], quant_n_grid=opts["mse_grid"], quant_norm=opts["mse_norm"]
    )


@dataclass
class _Grid:
    """A weight's quantization grid per group: zero points, fp16-rounded scales (as AWQ stores
    them) and inverse scales, each ``(..., N, ceil(K/G))``; applied to ``(..., N, K)``
    weights group by group (no per-element copies: for a batch of 24 DeepSeek experts these
    were 12.7 GB)."""

    zero: torch.Tensor
    s16: torch.Tensor
    inv: torch.Tensor
    g: int
    k: int

    def __getitem__(self, i: int) -> _Grid:
        return _Grid(self.zero[i], self.s16[i], self.inv[i], self.g, self.k)

    def apply(self, x: torch.Tensor, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``fn(x, zero, s16, inv)`` with ``x`` viewed ``(..., N, K/G, G)`` (zero-padded to whole
        groups) and the grid broadcast over each group; the result as ``(..., N, K)``."""
        g, k = self.g, self.k
        ng = self.zero.shape[-1]
        if ng * g != k:
            x = F.pad(x, (0, ng * g - k))
        y = fn(
            x.reshape(*x.shape[:-1], ng, g), self.zero[..., None], self.s16[..., None], self.inv[..., None]
        )
        return y.reshape(*x.shape[:-1], ng * g)[..., :k]


def _decode(qmeta: torch.Tensor, g: int, k: int, device) -> _Grid:
    """The grid ``(..., N, K/G, 4)`` decoded on ``device`` (one host round trip for a whole
    batch of grids: the codes decoded on the host, the grid's elementwise arithmetic on
    ``device``, where a batch of 10 DeepSeek experts' 2.3M groups took tens of ms on the host)."""
    from .quant import decode_qmeta

    scale, zero, sym = (t.to(device) for t in decode_qmeta(qmeta))
    z = torch.where(sym, torch.full_like(zero, 8), zero).float()
    return _Grid(z, scale.half().float(), 1.0 / scale, g, k)


def _dequant(codes: torch.Tensor, grid: _Grid) -> torch.Tensor:
    """``(N, K)`` float32 weight of codes ``(K, N)``, exactly as the AWQ checkpoint dequantizes
    (``(q − z) · fp16(scale)``), on the codes' device."""
    return grid.apply(codes.t().float(), lambda q, z, s16, _inv: (q - z) * s16)


def _rtn_dequant(w: torch.Tensor, grid: _Grid) -> torch.Tensor:
    """Round to nearest on the same grid (the report's RTN baseline), on ``w``'s device."""

    def rtn(x, z, s16, inv):
        return (torch.clamp(torch.round(x * inv + z), 0, 15) - z) * s16

    return grid.apply(w.float(), rtn)


def _info(method: str, tokens: int, fallback, t0: float, damp=None, retries=0, dead=0) -> dict:
    return {
        "method": method,
        "damp": damp,
        "retries": retries,
        "dead": dead,
        "tokens": tokens,
        "fallback": fallback,
        "seconds": time.perf_counter() - t0,
    }


def _solve(w: torch.Tensor, h: torch.Tensor | None, opts: dict, tokens: int, fallback: str | None) -> _Solved:
    """GPTQ of one weight ``(N, K)`` with ``H`` (or RTN when ``h`` is None), plus its report row."""
    if h is not None:
        return _solve_batch(w[None], h[None], opts, [tokens], [fallback])[0]
    with PHASES("gptq"):
        g = opts["group_size"]
        t0 = time.perf_counter()
        w32 = w.float().contiguous()
        qmeta, _, _ = build_quant_grid(w32, g, 4, opts["symmetric"], opts["grid"], **_grid_kw(opts))
        codes = quantize_rtn(w32, qmeta, 4, g).to(w32.device)
        grid = _decode(qmeta, g, w32.shape[1], w32.device)
        return _Solved(codes, qmeta, _dequant(codes, grid), _info("rtn", tokens, fallback, t0), grid)


def _solve_batch(
    w: torch.Tensor, h: torch.Tensor, opts: dict, tokens: list[int], fallbacks: list
) -> list[_Solved]:
    """GPTQ of ``B`` weights of one shape ``(B, N, K)`` with their Hessians ``(B, K, K)`` in one
    batched preparation and solve (the fused CUDA kernels on a GPU)."""
    from .quant import gptq_solve_batched, prepare_hessian_batched

    with PHASES("gptq"):
        g = opts["group_size"]
        t0 = time.perf_counter()
        b, n, k = w.shape
        w32 = w.float().contiguous()
        with PHASES("gptq: grid"):
            qmeta, _, _ = build_quant_grid(
                w32.reshape(b * n, k), g, 4, opts["symmetric"], opts["grid"], **_grid_kw(opts)
            )
            qmeta = qmeta.reshape(b, n, -1, 4)
        with PHASES("gptq: prepare"):
            u, perm, damp, retries, dead = prepare_hessian_batched(
                h.float().contiguous(), opts["damp"], opts["act_order"]
            )
        with PHASES("gptq: solve"):
            codes, _ = gptq_solve_batched(
                w32.transpose(1, 2).contiguous(), u, qmeta.to(u.device), 4, g, opts["block_size"], perm
            )
        del u
        dt = (time.perf_counter() - t0) / b
        out = []
        grids = _decode(qmeta, g, k, w.device)
        for i in range(b):
            grid = grids[i]
            c = codes[i].to(w.device)
            info = _info(
                "gptq", tokens[i], fallbacks[i], time.perf_counter() - dt, damp[i], retries[i], dead[i]
            )
            out.append(_Solved(c, qmeta[i], _dequant(c, grid), info, grid))
        return out


def report_errors(solved: list[tuple[torch.Tensor, _Solved, torch.Tensor | None]]) -> None:
    """Adds GPTQ's and RTN's (same grid) relative output errors to the report row of each
    ``(W, solved, H)`` (None without a Hessian). The sums stay on the device and come to the
    host in one sync (an expert batch has hundreds of them)."""
    with PHASES("report errors"):
        sums = []
        for w, s, h in solved:
            if h is None:
                s.info.update(err_gptq=None, err_rtn=None)
                continue
            wd = w.to(h.device).float()
            sums.append((s, _error_sums(wd, [s.deq.to(h.device), _rtn_dequant(wd, s.grid)], h)))
        if not sums:
            return
        dev = sums[0][1].device
        values = torch.stack([t.to(dev) for _, t in sums]).tolist()
        for (s, _), row in zip(sums, values, strict=True):
            s.info.update(zip(("err_gptq", "err_rtn"), _relative(row), strict=True))


def _host_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor in page-locked memory (fast, asynchronous copies to and from the
    GPU; torch's caching host allocator reuses freed blocks), or in pageable memory when
    pinning is refused (slower copies, same results)."""
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:
        return torch.empty(shape, dtype=dtype)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t`` (from a GPU, into page-locked memory)."""
    if not t.is_cuda:
        return t.contiguous()
    return _host_buffer(t.shape, t.dtype).copy_(t)


# --------------------------------------------------------------------------------------
# Activation storage


class _Store:
    """Per-chunk tensors kept on the compute device, in host memory, or in files.

    Chunks in host memory read by a GPU are copied one ahead: reading chunk ``i`` starts the
    copy of chunk ``i + 1`` (wrapping around) on a side stream, so the next chunk crosses the
    bus while this one computes (at 2M tokens an 80 GB card reads 29 GB per pass this way)."""

    def __init__(self, where: str, device: torch.device, folder: Path | None):
        self.where, self.device, self.folder = where, device, folder
        self.items: list[Any] = []
        self.meta: list[Any] = []
        self._ahead: tuple[int, torch.Tensor, Any] | None = None  # (chunk, copy, its event)
        self._copy_stream = None
        if where == "disk" and folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def append(self, t: torch.Tensor) -> None:
        self.items.append(None)
        self.meta.append(None)
        self[len(self.items) - 1] = t

    def shape(self, i: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """Chunk ``i``'s dtype and shape, without loading it."""
        return self.meta[i]

    def nbytes(self) -> int:
        """Bytes of all chunks, without loading them."""
        return sum(math.prod(shape) * dt.itemsize for dt, shape in self.meta)

    def _forget_ahead(self, i: int | None = None) -> None:
        """Drops the copy made ahead (of chunk ``i`` only, when given), after it finished: its
        page-locked source may be about to be overwritten."""
        if self._ahead is not None and (i is None or self._ahead[0] == i):
            self._ahead[2].synchronize()
            self._ahead = None

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        self._forget_ahead(i)
        self.meta[i] = (t.dtype, tuple(t.shape))
        if self.where == "gpu":
            self.items[i] = t.to(self.device)
        elif self.where == "cpu":
            if t.is_cuda:
                # straight into page-locked memory, reusing the chunk's buffer when it fits
                old = self.items[i]
                if not (isinstance(old, torch.Tensor) and old.shape == t.shape and old.dtype == t.dtype):
                    old = _host_buffer(t.shape, t.dtype)
                self.items[i] = old.copy_(t.detach())
            else:
                self.items[i] = t.detach().to("cpu")
        else:
            assert self.folder is not None
            p = self.folder / f"act-{id(self)}-{i}.pt"
            torch.save(t.detach().cpu(), p)
            self.items[i] = p

    def __getitem__(self, i: int) -> torch.Tensor:
        v = self.items[i]
        if isinstance(v, Path):
            return torch.load(v, map_location=self.device, weights_only=True)
        if not (self.where == "cpu" and self.device.type == "cuda"):
            return v.to(self.device, non_blocking=True)
        here = torch.cuda.current_stream(self.device)
        out = None
        if self._ahead is not None:
            j, t, ev = self._ahead
            self._ahead = None
            if j == i:
                here.wait_event(ev)
                t.record_stream(here)  # its memory came from the side stream's pool
                out = t
        if out is None:
            out = v.to(self.device, non_blocking=True)
        nxt = (i + 1) % len(self.items)
        if nxt != i and isinstance(self.items[nxt], torch.Tensor):
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                t = self.items[nxt].to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._copy_stream)
            self._ahead = (nxt, t, ev)
        return out

    def __len__(self) -> int:
        return len(self.items)

    def drop(self) -> None:
        self._forget_ahead()
        for v in self.items:
            if isinstance(v, Path):
                v.unlink(missing_ok=True)
        self.items, self.meta = [], []


_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int64: "I64",
}


def write_safetensors(
    path: str,
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    sources: dict[str, Callable[[], torch.Tensor]],
) -> None:
    """Writes a safetensors file one tensor at a time: ``shapes`` gives each tensor's dtype and
    shape for the header, ``sources[name]()`` the tensor when its bytes are due (so only one is
    in host memory at a time, unlike ``safetensors.torch.save_file``)."""
    header, at = {}, 0
    for name, (dt, shape) in shapes.items():
        n = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, (dt, shape) in shapes.items():
            t = sources[name]().detach().to("cpu").contiguous()
            if t.dtype != dt or tuple(t.shape) != tuple(shape):
                raise InvalidValueError(f"{path}: tensor {name} changed while being written")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def _gpu_room(device: torch.device) -> int:
    """Bytes the caching allocator can still hand out on ``device``: the driver's free memory
    plus what torch holds reserved but unused (``mem_get_info`` alone misses the latter)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _host_room() -> int:
    """Bytes of host memory still available (unbounded when the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


_SOLVE_RESERVE = 0.15
"""Share of the GPU's memory kept free of activations for the expert solves."""


def _gpu_total(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def _where(opts: dict, device: torch.device, nbytes: int, layer_bytes: int) -> str:
    """Where the activations (``nbytes``) live: on the GPU when it holds them twice (the
    chunks, which the attention residuals overwrite in place, and the collected expert
    inputs) beside the largest layer in the compute dtype (at most twice its source bytes,
    FP8 to bf16) and the solves' reserve; else in host memory when it holds them twice (the
    chunks, and the expert inputs when the GPU cannot); else on disk."""
    want = opts["activations"]
    if want != "auto":
        return want
    if device.type == "cuda":
        need = 2 * nbytes + 2 * layer_bytes + _SOLVE_RESERVE * _gpu_total(device)
        if need <= _gpu_room(device):
            return "gpu"
    return "cpu" if 2 * nbytes < 0.8 * _host_room() else "disk"


# --------------------------------------------------------------------------------------
# Model families: what transformers calls things, and where the routed experts are


@dataclass(frozen=True)
class _Experts:
    """Naming of a family's routed experts in the checkpoint."""

    block: tuple[str, ...]  # attribute names of the MoE block inside the decoder layer
    ckpt_block: tuple[str, ...]  # its name prefix in checkpoints (first found wins)
    gate: str
    up: str
    down: str
    scoring: str  # "sigmoid" or "softmax": how router probability mass is measured


_FAMILY_EXPERTS = {
    "deepseek": _Experts(("mlp",), ("mlp",), "gate_proj", "up_proj", "down_proj", "sigmoid"),
    "qwen-moe": _Experts(("mlp",), ("mlp",), "gate_proj", "up_proj", "down_proj", "softmax"),
    "mixtral": _Experts(
        ("mlp", "block_sparse_moe"), ("block_sparse_moe", "mlp"), "w1", "w3", "w2", "softmax"
    ),
    "generic": _Experts(("mlp",), ("mlp",), "gate_proj", "up_proj", "down_proj", "softmax"),
}


def _tensor(sess, name: str) -> torch.Tensor:
    mt = sess.tensor(name)
    dt = _DTYPES.get(mt.dtype)
    if dt is None:
        raise CheckpointError(
            f"{mt.file}: tensor {name!r} has dtype {mt.dtype}, which a forward pass cannot use"
        )
    shape = list(mt.shape)
    if len(mt) == 0:
        return torch.empty(shape, dtype=dt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mmap: never written
        t = torch.frombuffer(mt, dtype=torch.uint8)
    return t.view(dt).reshape(shape)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a view of the mapped source) on ``device``. To a GPU through page-locked memory:
    a (parallel) host copy out of the mapping, then a DMA that does not block; a pageable copy
    of a DeepSeek-V3 layer (11.6 GB in ~2000 tensors) ran at ~8 GB/s. Torch's caching host
    allocator reuses the staging blocks once their copies are done."""
    if device.type != "cuda" or t.device.type != "cpu" or t.numel() == 0:
        return t.to(device)
    return _host_buffer(t.shape, t.dtype).copy_(t).to(device, non_blocking=True)


def _load_weight(sess, name: str, device: torch.device, dtype: torch.dtype, block: int) -> torch.Tensor:
    """A source tensor on ``device``: FP8 times its ``weight_scale_inv`` per block, else cast."""
    with PHASES("read"):
        t = _tensor(sess, name)
        if t.dtype == torch.float8_e4m3fn or t.dtype == dtype or not t.is_floating_point():
            t = _upload(t, device)
    if t.dtype == torch.float8_e4m3fn:
        with PHASES("fp8 dequant"):
            return _fp8_dequant(sess, name, t, device, dtype, block)
    if t.is_floating_point():
        with PHASES("read"):
            return t.to(device=device, dtype=dtype)
    return t


def _fp8_dequant(sess, name: str, t: torch.Tensor, device, dtype, block: int) -> torch.Tensor:
    """``t`` (FP8, on ``device``) times its ``weight_scale_inv`` per ``block x block`` block."""
    from .loading import dequantize_fp8_blocks

    scale_name = f"{name}_scale_inv"
    if not sess.has_tensor(scale_name):
        raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name}")
    s = _tensor(sess, scale_name)
    where = f"{sess.tensor(name).file}: {name}"
    return dequantize_fp8_blocks(t, s, (block, block), where).to(dtype)


# --------------------------------------------------------------------------------------
# The routed experts during calibration


_GROUPED_MM: dict[tuple[str, int | None], bool] = {}


def _grouped_mm_runs(device: torch.device) -> bool:
    """Whether this torch's ``torch._grouped_mm`` (2D inputs x 3D weights with offsets, bf16)
    runs on ``device``, tried once per device on a tiny problem, since which devices a torch
    release supports varies; on CUDA only Hopper or newer is tried (older GPUs: experts one by
    one)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    if key not in _GROUPED_MM:
        ok = hasattr(torch, "_grouped_mm") and (
            device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)
        )
        if ok:
            a = torch.ones(32, 16, dtype=torch.bfloat16, device=device)
            b = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            try:
                ok = bool((torch._grouped_mm(a, b.transpose(1, 2), offs=offs) == 16).all())
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


class _RoutedExperts(torch.nn.Module):
    """Replaces a transformers experts module (``forward(x, top_k_index, top_k_weights)``).

    ``collect``: records inputs, ids and weights of every token and returns zeros.
    ``replay``: returns the routed output computed expert-major after quantization.
    ``run``: computes the routed output directly (per chunk; used when not sequential).

    The experts' weights are stacked, ``gate_up (E, 2I, D)`` (gate rows, then up rows) and
    ``down (E, D, I)``: one expert is a view, and a grouped GEMM reads all of them.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.n_experts, self.act = gate_up.shape[0], act
        self.mode = "run"
        self.collected: _Collected | None = None
        self.replay_rows: torch.Tensor | None = None
        self.replay_at = 0
        self.stats: _Stats | None = None
        self.remap: torch.Tensor | None = None  # remap layout: original id -> compact id or -1

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.remap is not None:
            top_k_index, top_k_weights = self.remapped(top_k_index, top_k_weights)
        if self.mode == "collect":
            assert self.collected is not None
            self.collected.add(x.detach(), top_k_index.detach(), top_k_weights.detach())
            return torch.zeros_like(x)
        if self.mode == "zero":
            return torch.zeros_like(x)
        if self.mode == "replay":
            assert self.replay_rows is not None
            t = x.shape[0]
            out = self.replay_rows[self.replay_at : self.replay_at + t].to(x.device, x.dtype)
            self.replay_at += t
            return out
        return self.compute(x, top_k_index, top_k_weights)

    def remapped(self, idx: torch.Tensor, wts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The remap layout's routing (what forge's vLLM plugin computes): ids through the layer's
        map, pruned picks weighted 0 and the rest rescaled to the token's original weight sum.
        Pruned picks go to the bucket ``n_experts``, which no expert reads."""
        m = self.remap
        ids, w = remap_routing(idx, wts, m)
        ids = torch.where(m[idx.long()] >= 0, ids.to(idx.dtype), self.n_experts)
        return ids, w.to(wts.dtype)

    def keep(self, ids: list[int]) -> None:
        """Keeps experts ``ids`` (compact expert ``c`` is ``ids[c]``). Ascending ids are moved
        down in place (no second copy of the weights at any time); other orders are gathered."""
        if all(a < b for a, b in zip(ids, ids[1:], strict=False)):
            for c, e in enumerate(ids):
                if c != e:
                    self.gate_up[c].copy_(self.gate_up[e])
                    self.down[c].copy_(self.down[e])
            self.gate_up, self.down = self.gate_up[: len(ids)], self.down[: len(ids)]
        else:
            ix = torch.tensor(ids, device=self.gate_up.device)
            self.gate_up, self.down = self.gate_up.index_select(0, ix), self.down.index_select(0, ix)
        self.n_experts = len(ids)

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of stacked gate/up outputs ``h (..., 2I)`` (gate columns first)."""
        i = h.shape[-1] // 2
        return self.act(h[..., :i]).mul_(h[..., i:])

    def hidden(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s down-projection input ``act(x Gᵀ) * (x Uᵀ)``: gate and up in one GEMM."""
        return self.gated(F.linear(x, self.gate_up[e]))

    def output(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s output for its tokens ``x``, in float32."""
        return _mm_f32(self.hidden(e, x), self.down[e].t())

    def grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a routed output on ``device`` in ``dtype`` runs as grouped GEMMs
        (``torch._grouped_mm``: bf16 on Hopper or newer, rows 16-byte aligned) rather than
        expert by expert."""
        return (
            device.type == "cuda"
            and dtype == self.gate_up.dtype == torch.bfloat16
            and self.gate_up.shape[-1] % 8 == 0
            and self.down.shape[-1] % 8 == 0
            and _grouped_mm_runs(device)
        )

    def compute(self, x, idx, wts) -> torch.Tensor:
        """The routed output of tokens ``x (T, D)`` (router weight times expert output, summed
        over the token's experts), in ``x``'s dtype; REAP sums into ``stats`` (one host sync)."""
        if self.grouped(x.device, x.dtype):
            return self._compute_grouped(x, idx, wts)
        return self._compute_per_expert(x, idx, wts)

    def _compute_per_expert(self, x, idx, wts) -> torch.Tensor:
        """Expert by expert: each expert's fp32 output times the router weight, summed in fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)[: self.n_experts].tolist()
        k = idx.shape[1]
        reap = torch.zeros(self.n_experts, dtype=torch.float64, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start : start + c]
            start += c
            tok = sel // k
            wt = wts.reshape(-1)[sel].float()
            y = self.output(e, x.index_select(0, tok))
            if self.stats is not None:
                reap[e] = (wt * y.norm(dim=-1)).double().sum()
            # an expert sees a token once: distinct rows, so the adds are deterministic
            out.index_add_(0, tok, y.mul_(wt[:, None]))
        if self.stats is not None:
            self.stats.reap += reap.cpu()
        return out.to(x.dtype)

    def _compute_grouped(self, x, idx, wts) -> torch.Tensor:
        """All experts in two grouped GEMMs over the (token, expert) pairs sorted by expert, no
        host sync: ``a = act(x Gᵀ) * (x Uᵀ) * w`` (the router weight folded into the bf16
        down-projection input), ``y = a Dᵀ`` in bf16, and each token's ``k`` rows of ``y``
        summed with fp32 accumulation by one ``embedding_bag``. A remap layout's pruned picks
        (weight 0) run through expert 0 and give exact zeros. Router weights are nonnegative
        (softmax / sigmoid scores), so REAP's ``w · ‖y‖`` is the norm of the weighted row."""
        t, k = idx.shape
        n = self.n_experts
        if idx.numel() == 0:
            return torch.zeros_like(x)
        flat = idx.reshape(-1).long()
        if self.remap is not None:
            flat = torch.where(flat < n, flat, 0)
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=n)[:n].cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x.index_select(0, order // k), self.gate_up.transpose(1, 2), offs=offs)
        a = self.gated(h).mul_(wts.reshape(-1).float()[order, None])
        del h
        y = torch._grouped_mm(a, self.down.transpose(1, 2), offs=offs)
        del a
        if self.stats is not None:
            reap = torch.zeros(n, dtype=torch.float64, device=x.device)
            reap.index_add_(0, flat[order], torch.linalg.vector_norm(y, dim=-1, dtype=torch.float32).double())
            self.stats.reap += reap.cpu()
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel(), device=order.device)
        return F.embedding_bag(pos.view(t, k), y, mode="sum")  # bf16, as x (see grouped)


class _Collected:
    """Every calibration token's input to the routed experts, in one buffer allocated up front
    (on the compute device when it takes at most 60 % of the memory left, else in pinned host
    memory), with its expert ids and router weights. After the experts are solved the buffer
    holds the layer's routed output instead, computed in place window by window."""

    DEVICE_SHARE = 0.6  # of the memory left on the compute device

    def __init__(self, tokens: int, d: int, dtype: torch.dtype, device: torch.device):
        nbytes = tokens * d * dtype.itemsize
        on_device = device.type != "cuda" or nbytes <= self.DEVICE_SHARE * _gpu_room(device)
        if on_device:
            self.x = torch.empty(tokens, d, dtype=dtype, device=device)
        else:
            self.x = _host_buffer((tokens, d), dtype)
        self.at = 0
        self.ids: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        n = x.shape[0]
        if self.at + n > self.x.shape[0]:
            raise InvalidValueError("internal: more routed tokens than calibration tokens")
        self.x[self.at : self.at + n].copy_(x, non_blocking=True)
        self.at += n
        self.ids.append(idx)
        self.weights.append(wts)

    def rows(self, tok: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The inputs of tokens ``tok`` (ids on ``device``) on ``device``."""
        if self.x.device == tok.device:
            return self.x.index_select(0, tok)
        return self.x.index_select(0, tok.cpu()).to(device, non_blocking=True)


@dataclass
class _Stats:
    """Per-layer router statistics (token counts, probability mass, REAP saliency sums)."""

    n: int
    counts: torch.Tensor = field(init=False)
    mass: torch.Tensor = field(init=False)
    reap: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.counts = torch.zeros(self.n, dtype=torch.float64)
        self.mass = torch.zeros(self.n, dtype=torch.float64)
        self.reap = torch.zeros(self.n, dtype=torch.float64)

    def add_routing(self, logits: torch.Tensor, idx: torch.Tensor, scoring: str) -> None:
        lf = logits.float().reshape(-1, self.n)
        p = lf.sigmoid() if scoring == "sigmoid" else lf.softmax(-1)
        self.mass += p.sum(0).double().cpu()
        self.counts += torch.bincount(idx.reshape(-1).cpu(), minlength=self.n).double()[: self.n]


# --------------------------------------------------------------------------------------
# The run


def _stages(names: list[str], moe: str | None, true_sequential: bool) -> list[list[str]]:
    """Groups a layer's quantized linears (and the routed experts, ``"<experts>"``) in the
    order the forward reaches them; each stage sees the quantized outputs of the earlier ones."""
    rank = [
        ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.qkv_proj"),
        ("self_attn.q_b_proj", "self_attn.kv_b_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
         "shared_expert.gate_proj", "shared_expert.up_proj", "<experts>"),
        ("mlp.down_proj", "shared_experts.down_proj", "shared_expert.down_proj"),
    ]  # fmt: skip
    items = list(names) + (["<experts>"] if moe else [])
    if not true_sequential:
        return [items]
    out: list[list[str]] = [[] for _ in range(len(rank) + 1)]
    for n in items:
        i = next(
            (j for j, keys in enumerate(rank) if any(n == k or n.endswith("." + k) for k in keys)), len(rank)
        )
        out[i].append(n)
    return [s for s in out if s]


@dataclass
class _Ctx:
    sess: Any
    opts: dict
    cfg: Any
    device: torch.device
    dtype: torch.dtype
    family: str
    block: int
    prefix: str
    report: list[dict]
    stats: dict[int, _Stats]
    progress: bool
    layer_seconds: dict[int, float]
    pruning: dict | None = None  # the session's pruning plan (layout, criterion, keep per layer)
    bound: dict[int, list[int]] = field(default_factory=dict)  # layer -> kept original expert ids
    stats_source: str = "calibration"


def _build_layer(ctx: _Ctx, meta_layers, unit: dict):
    """The decoder layer ``unit['layer']`` on the compute device, weights from the checkpoint;
    routed experts moved into a :class:`_RoutedExperts` (per-expert weights)."""
    import copy

    li = unit["layer"]
    layer = copy.deepcopy(meta_layers[li])  # the meta model keeps its own, empty, layer
    pre = f"{ctx.prefix}{li}."
    fam = _FAMILY_EXPERTS.get(ctx.family, _FAMILY_EXPERTS["generic"])
    names = {t["name"] for t in unit["tensors"]}
    moe_attr = next((a for a in fam.block if hasattr(getattr(layer, a, None), "experts")), None)
    routed = None
    if moe_attr is not None:
        block = getattr(layer, moe_attr)
        ck = next(
            (c for c in fam.ckpt_block if ctx.sess.has_tensor(f"{pre}{c}.experts.0.{fam.gate}.weight")), None
        )
        if ck is None:
            raise CheckpointError(
                f"layer {li}: the model has routed experts but the checkpoint stores none as "
                f"{pre}{fam.ckpt_block[0]}.experts.<e>.{fam.gate}.weight (per-expert tensors are required)"
            )
        n_exp = int(getattr(block.experts, "num_experts", 0) or len(block.gate.weight))
        act = block.experts.act_fn
        # Swap the fused experts out before anything is allocated: forge keeps them per expert.
        block.experts = torch.nn.Identity()
        gate_up = down = None
        for e in range(n_exp):
            ws = []
            for leaf in (fam.gate, fam.up, fam.down):
                nm = f"{pre}{ck}.experts.{e}.{leaf}.weight"
                if not ctx.sess.has_tensor(nm):
                    raise CheckpointError(f"layer {li}: missing tensor {nm!r}")
                ws.append(_load_weight(ctx.sess, nm, ctx.device, ctx.dtype, ctx.block))
            g, u, d = ws
            if g.shape != u.shape or d.shape != g.shape[::-1]:
                raise ShapeError(
                    f"layer {li}: expert {e}: {fam.gate} {tuple(g.shape)}, {fam.up} {tuple(u.shape)} "
                    f"and {fam.down} {tuple(d.shape)} do not form an (I, D), (I, D), (D, I) MLP"
                )
            if gate_up is None:
                gate_up = torch.empty((n_exp, 2 * g.shape[0], g.shape[1]), dtype=g.dtype, device=g.device)
                down = torch.empty((n_exp, *d.shape), dtype=d.dtype, device=d.device)
            elif tuple(d.shape) != tuple(down.shape[1:]):
                raise ShapeError(
                    f"layer {li}: expert {e}: {fam.down} {tuple(d.shape)}, expert 0's "
                    f"{tuple(down.shape[1:])}: the routed experts of a layer must have one shape"
                )
            gate_up[e, : g.shape[0]].copy_(g)
            gate_up[e, g.shape[0] :].copy_(u)
            down[e].copy_(d)
        routed = _RoutedExperts(gate_up, down, act)
        routed.ckpt_prefix = f"{pre}{ck}.experts."  # type: ignore[attr-defined]
    layer.to_empty(device=ctx.device)
    if routed is not None:
        getattr(layer, moe_attr).experts = routed
    # Every other parameter and buffer from the checkpoint.
    missing = []
    for pname, p in list(layer.named_parameters()) + list(layer.named_buffers()):
        if routed is not None and ".experts." in f".{pname}.":
            continue
        cands = [pre + pname]
        if moe_attr == "mlp":
            cands.append(pre + pname.replace("mlp.", "block_sparse_moe.", 1))
        src = next((c for c in cands if c in names or ctx.sess.has_tensor(c)), None)
        if src is None:
            missing.append(pre + pname)
            continue
        v = _load_weight(
            ctx.sess,
            src,
            ctx.device,
            p.dtype
            if not p.is_floating_point()
            else (torch.float32 if p.dtype == torch.float32 and "bias" in pname else ctx.dtype),
            ctx.block,
        )
        if tuple(v.shape) != tuple(p.shape):
            raise CheckpointError(
                f"tensor {src!r} has shape {tuple(v.shape)}, the model expects {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.data = v
    if missing:
        raise CheckpointError(
            f"layer {li}: {len(missing)} tensor(s) missing from the checkpoint, first {missing[0]!r}"
        )
    layer.eval()
    return layer, routed, moe_attr


def _module_name(unit_prefix: str, linear_module: str) -> str:
    return linear_module[len(unit_prefix) :]


def run_layerwise(model_dir: str | os.PathLike, out_dir: str | os.PathLike, options: dict) -> dict:
    """The layer-by-layer forward over calibration text, and what rides on it: GPTQ
    (``method="gptq"``), router statistics (always, for MoE layers; alone with ``stats_only``)
    and expert pruning decided from them layer by layer (``keep_experts`` / ``prune_ratio``),
    followed by RTN (``method="rtn"``) or no quantization (``method="none"``) when not GPTQ.
    Returns the run report (as the native run does)."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    global PHASES
    PHASES = _Phases()
    t_start = time.perf_counter()
    sess = _native.Session(os.fspath(model_dir), os.fspath(out_dir), json.dumps(options))
    opts = sess.options()
    summary = sess.summary()
    pruning = _pruning_of(summary)
    if pruning and pruning["bound_at_open"] and opts["method"] != "gptq":
        return _run_bound(sess, opts, summary, pruning)
    device = torch.device(opts["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidValueError("device: CUDA was asked for but torch sees no GPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many kinds
        raise CheckpointError(
            f"{model_dir}: transformers cannot build this model ({exc}); GPTQ supports Llama-like dense "
            "models, DeepSeek-V2/V3, Qwen2/3-MoE and Mixtral"
        ) from exc
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # FP8 sources are dequantised here, not by transformers
    cfg._attn_implementation = "sdpa"
    try:
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except Exception as exc:
        raise CheckpointError(
            f"{model_dir}: transformers has no causal-LM class for model_type "
            f"{getattr(cfg, 'model_type', '?')!r} ({exc}); GPTQ supports Llama-like dense models, "
            "DeepSeek-V2/V3, Qwen2/3-MoE and Mixtral"
        ) from exc
    base = meta_model.get_decoder() if hasattr(meta_model, "get_decoder") else meta_model.model
    meta_layers = getattr(base, "layers", None)
    rotary_cls = type(getattr(base, "rotary_emb", None))
    if meta_layers is None or rotary_cls is type(None):
        raise CheckpointError(
            f"{model_dir}: {type(meta_model).__name__} has no decoder layers / rotary embedding forge knows"
        )
    maxpos = getattr(cfg, "max_position_embeddings", None)
    if maxpos and opts["seqlen"] > maxpos:
        raise InvalidValueError(
            f"seqlen: {opts['seqlen']} is longer than the model allows (max_position_embeddings {maxpos})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception:
        tokenizer = None
    ids = load_calibration(opts["calib"], tokenizer, opts["nsamples"], opts["seqlen"], opts["seed"])
    vocab = getattr(cfg, "vocab_size", None)
    if vocab and int(ids.max()) >= vocab:
        raise InvalidValueError(f"calib: token id {int(ids.max())} is outside the vocabulary ({vocab})")

    units = sess.units()
    names_all = [t["name"] for u in units for t in u["tensors"]]
    embed = next((n for n in names_all if n.endswith("embed_tokens.weight")), None)
    layer_units = [u for u in units if u["layer"] is not None]
    prefix = ""
    if layer_units:
        first = layer_units[0]["tensors"][0]["name"]
        prefix = first[: first.index(f".{layer_units[0]['layer']}.") + 1]
    block = int(summary["fp8_block"])
    qc = (sess.config() or {}).get("quantization_config") or {}
    if isinstance(qc.get("weight_block_size"), list) and qc["weight_block_size"]:
        block = int(qc["weight_block_size"][0])
    ctx = _Ctx(sess, opts, cfg, device, dtype, summary["arch"], block, prefix, [], {}, opts["progress"], {})
    ctx.pruning = _pruning_of(summary)
    ctx.bound = kept_experts(sess.expert_map() or {}) if ctx.pruning else {}
    ctx.stats_source = "router_stats file" if ctx.pruning and ctx.pruning["bound_at_open"] else "calibration"

    # Chunks of whole windows.
    per = max(1, opts["chunk_tokens"] // opts["seqlen"])
    chunks = [ids[i : i + per] for i in range(0, len(ids), per)]
    hidden_bytes = ids.numel() * cfg.hidden_size * dtype.itemsize
    where = _where(opts, device, hidden_bytes, max((u["bytes_in"] for u in layer_units), default=0))
    off = Path(opts["offload_dir"]) if opts["offload_dir"] else Path(out_dir) / "forge-state" / "activations"
    notes = [f"calibration: {ids.shape[0]} windows x {ids.shape[1]} tokens, activations on {where}"]

    with torch.device(device):
        rotary = rotary_cls(config=cfg)
    hidden = _Store(where, device, off / "hidden")
    resume = sess.resume_state()
    if resume is not None:
        from safetensors import safe_open

        with safe_open(resume[1], "pt") as st:
            for i in range(len(chunks)):
                hidden.append(st.get_tensor(f"hidden.{i}"))
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if k.startswith("stats."):
                    _, li, what = k.split(".")
                    v = st.get_tensor(k)
                    s = ctx.stats.setdefault(int(li), _Stats(v.numel()))
                    setattr(s, what, v.double())
            report = st.get_tensor("report") if "report" in st.keys() else torch.zeros(0, dtype=torch.uint8)  # noqa: SIM118
        ctx.report.extend(json.loads(report.numpy().tobytes() or b"[]"))
        notes.append(f"resumed after {resume[0]}")

    bar = tqdm(total=len(units), desc="layers", disable=not opts["progress"], unit="unit")
    abort_after = int(os.environ.get(ABORT_ENV, "0") or 0)
    processed = 0
    last_layer = max((u["index"] for u in layer_units if not u["mtp"]), default=-1)
    saving = _StatePolicy()
    todo = [u["index"] for u in units if not u["done"]]
    following = dict(zip(todo, todo[1:], strict=False))
    commits = _Commits(sess)
    try:
        for u in units:
            if u["done"]:
                bar.update(1)
                continue
            t0 = time.perf_counter()
            if u["index"] in following:  # the next unit's bytes are read while this one computes
                sess.prefetch(following[u["index"]])
            state_path = None
            if u["layer"] is None:
                with PHASES("write unquantized"):
                    sess.write_unquantized(u["index"])
                if len(hidden) == 0:
                    if embed is None:
                        raise CheckpointError(
                            f"{model_dir}: no embed_tokens.weight among the non-layer tensors"
                        )
                    w = _load_weight(sess, embed, device, dtype, block)
                    for c in chunks:
                        hidden.append(F.embedding(c.to(device), w))
                    del w
            elif not u["mtp"]:
                if len(hidden) == 0:
                    raise CheckpointError("internal: no calibration hidden states before the first layer")
                _process_layer(ctx, meta_layers, rotary, u, hidden, chunks, bar)
                # After the layer: a pruned layer's experts are bound to their sources by now.
                with PHASES("write unquantized"):
                    sess.write_unquantized(u["index"])
                if opts["method"] == "rtn":
                    with PHASES("rtn"):
                        sess.quantize_rtn(u["index"])
                if u["index"] != last_layer and saving.due(hidden_bytes, time.perf_counter() - t0):
                    state_path = sess.state_path(u["index"])
                    t_save = time.perf_counter()
                    with PHASES("save state"):
                        _save_state(state_path, hidden, ctx)
                    saving.saved(hidden_bytes, time.perf_counter() - t_save)
            else:
                with PHASES("write unquantized"):
                    sess.write_unquantized(u["index"])
            commits.submit(u["index"], os.fspath(state_path) if state_path else None)
            ctx.layer_seconds[u["layer"] if u["layer"] is not None else -1] = time.perf_counter() - t0
            bar.update(1)
            processed += 1
            if abort_after and processed >= abort_after:
                raise RuntimeError(f"test abort after {processed} units ({ABORT_ENV})")
        commits.flush()
    finally:
        commits.close()
    bar.close()
    hidden.drop()
    PHASES.seconds["total"] = time.perf_counter() - t_start
    if device.type == "cuda":
        notes.append(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    extra = _reports(ctx, summary, notes)
    if ctx.pruning:
        from .prune import pruning_files

        extra += pruning_files(
            ctx.pruning,
            sess.expert_map() or {},
            ctx.stats,
            _scoring(ctx.family),
            (summary["bytes_in"], summary["bytes_out"]),
        )
    rep = sess.finish(extra)
    rep["notes"] = list(rep.get("notes", [])) + notes
    return rep


def _pruning_of(summary: dict) -> dict | None:
    """The session's pruning plan with integer layer keys (``None`` when not pruning)."""
    p = summary.get("pruning")
    if not p:
        return None
    p = dict(p)
    p["keep"] = {int(k): int(v) for k, v in p["keep"].items()}
    return p


def _run_bound(sess, opts: dict, summary: dict, pruning: dict) -> dict:
    """A pruning run whose experts were chosen at open from a saved ``router_stats`` file, with
    RTN or no quantization: no forward pass, unit by unit as the native run goes, plus the
    expert map and the pruning report (statistics from that file)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    from .prune import pruning_files, stats_heatmap

    units = sess.units()
    bar = tqdm(total=len(units), desc="layers", disable=not opts["progress"], unit="unit")
    for u in units:
        if not u["done"]:
            sess.write_unquantized(u["index"])
            if opts["method"] == "rtn":
                sess.quantize_rtn(u["index"])
            sess.commit(u["index"], None)
        bar.update(1)
    bar.close()
    stats: dict[int, _Stats] = {}
    with safe_open(opts["router_stats"], "pt") as f:
        layers = f.get_tensor("layers").tolist()
        counts, mass, reap = (f.get_tensor(k) for k in ("counts", "mass", "reap"))
    for row, li in enumerate(layers):
        s = stats[li] = _Stats(counts.shape[1])
        s.counts, s.mass, s.reap = counts[row].double(), mass[row].double(), reap[row].double()
    emap = sess.expert_map() or {}
    extra = pruning_files(
        pruning, emap, stats, _scoring(summary["arch"]), (summary["bytes_in"], summary["bytes_out"])
    )
    png = stats_heatmap(stats, kept_experts(emap))
    if png is not None:
        extra.append(("forge/router_stats.png", png))
    rep = sess.finish(extra)
    rep["notes"] = list(rep.get("notes", [])) + [f"experts chosen from {opts['router_stats']}"]
    return rep


class _Commits:
    """Commits finished units one unit late: unit i's shards and state are fsynced on a worker
    thread (``Session.sync_unit``) while unit i+1 computes, and recorded (``commit``) when
    unit i+1 is done, at the end, or when the run stops on an error."""

    def __init__(self, sess):
        from concurrent.futures import ThreadPoolExecutor

        self.sess, self.pending = sess, None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-sync")

    def submit(self, index: int, state: str | None) -> None:
        self.flush()
        self.pending = (index, state, self.pool.submit(self.sess.sync_unit, index, state))

    def flush(self) -> None:
        if self.pending is None:
            return
        index, state, synced = self.pending
        self.pending = None
        with PHASES("commit"):
            synced.result()
            self.sess.commit(index, state)

    def close(self) -> None:
        """Records the last finished unit even when the run is failing (its bytes are whole)."""
        try:
            self.flush()
        except Exception as exc:  # the run's own error is the one to report
            warnings.warn(f"could not record the last finished unit: {exc}", stacklevel=2)
        finally:
            self.pool.shutdown()


STATE_BUDGET = 0.1
"""Largest share of the run's time spent writing resume states. The activations entering the
next layer (2M tokens x 7168 x bf16 = 29 GB for DeepSeek-V3) are saved after a layer only when
the layers since the last save took at least ``1 / STATE_BUDGET - 1`` times what a save costs
(measured at the last save; estimated at 1 GB/s before the first); a resumed run redoes the
layers after the last save."""


class _StatePolicy:
    def __init__(self):
        self.since, self.per_byte = 0.0, 1e-9

    def due(self, nbytes: int, layer_seconds: float) -> bool:
        self.since += layer_seconds
        return self.since * STATE_BUDGET >= nbytes * self.per_byte * (1 - STATE_BUDGET)

    def saved(self, nbytes: int, seconds: float) -> None:
        self.since, self.per_byte = 0.0, seconds / max(nbytes, 1)


def _save_state(path: str, hidden: _Store, ctx: _Ctx) -> None:
    """The resume state (activations, router statistics, report rows so far) as a safetensors
    file, written tensor by tensor (one chunk in host memory at a time), fsynced by commit."""
    small = {}
    for li, s in ctx.stats.items():
        small[f"stats.{li}.counts"] = s.counts
        small[f"stats.{li}.mass"] = s.mass
        small[f"stats.{li}.reap"] = s.reap
    small["report"] = torch.frombuffer(bytearray(json.dumps(ctx.report).encode()), dtype=torch.uint8)
    sources: dict[str, Callable[[], torch.Tensor]] = {
        f"hidden.{i}": (lambda i=i: hidden[i]) for i in range(len(hidden))
    }
    sources.update({k: (lambda v=v: v) for k, v in small.items()})
    shapes = {f"hidden.{i}": hidden.shape(i) for i in range(len(hidden))}
    shapes.update({k: (v.dtype, tuple(v.shape)) for k, v in small.items()})
    tmp = f"{path}.partial"
    write_safetensors(tmp, shapes, sources)
    os.replace(tmp, path)


def _forward(layer, h: torch.Tensor, rotary) -> torch.Tensor:
    pos = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
    pe = rotary(h, pos)
    out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe, use_cache=False)
    return out[0] if isinstance(out, tuple) else out


_MLP_TAIL_LAYERS = frozenset(
    {
        "DeepseekV3DecoderLayer",
        "Qwen3MoeDecoderLayer",
        "Qwen2MoeDecoderLayer",
        "MixtralDecoderLayer",
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
    }
)
"""Decoder layers whose forward ends ``h + mlp(post_attention_layernorm(h))`` after the
attention residual ``h`` (checked against transformers' source by the tests)."""


class _AttnResiduals:
    """The attention half's output (the residual entering ``post_attention_layernorm``) of each
    calibration chunk, once every attention linear of the layer is final, written over that
    chunk's layer input in ``hidden`` (nothing later in the layer reads the input again): the
    later stages and the final pass then run only ``h + mlp(norm(h))`` instead of the whole
    layer (for a DeepSeek-V3 MoE layer, two attention passes instead of four). No memory
    beyond the activations themselves, wherever they live (GPU, host or files). Which chunks
    hold their residual is tracked chunk by chunk, so a forward that stopped before the norm
    leaves its chunk's input in place and that chunk is simply rerun."""

    def __init__(self, layer, hidden: _Store):
        self.layer, self.hidden = layer, hidden
        self.on = type(layer).__name__ in _MLP_TAIL_LAYERS
        self.residual: set[int] = set()  # chunks whose slot holds the residual
        self.ci: int | None = None  # the chunk whose full forward is running

    def start(self) -> bool:
        """Starts recording (one stage's forwards, chunk by chunk, once the attention is
        final); False when there is nothing to do."""
        if not self.on or len(self.residual) == len(self.hidden):
            return False
        self.handle = self.layer.post_attention_layernorm.register_forward_pre_hook(self._record)
        return True

    def _record(self, _m, args) -> None:
        if self.ci is not None:
            self.hidden[self.ci] = args[0]
            self.residual.add(self.ci)

    def stop(self) -> None:
        """Ends recording."""
        self.handle.remove()

    def forward(self, ci: int, rotary) -> torch.Tensor:
        """The layer's output for chunk ``ci``: from its residual once recorded."""
        if ci in self.residual:
            h = self.hidden[ci]
            return h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        self.ci = ci
        try:
            return _forward(self.layer, self.hidden[ci], rotary)
        finally:
            self.ci = None


def _input_hook(hs: dict, rel: str, seen: dict, aliases: dict, needed: int, stop: bool):
    """A forward pre-hook adding a linear's input to its Hessian ``hs[rel]``. A linear fed the
    very tensor another linear of the stage already received in this forward (q_a/kv_a, q/k/v,
    gate/up) shares that one's Hessian instead of accumulating the same XᵀX again. Once every
    linear of the stage has been seen (and nothing later is needed), the forward stops."""

    def hook(_m, args):
        x = args[0]
        if rel not in aliases:
            aliases[rel] = next((o for o, t in seen.items() if t is x), None)
            if aliases[rel] is not None:
                hs[rel] = hs[aliases[rel]]
        if aliases[rel] is None:
            hs[rel].add(x)
        seen[rel] = x
        if stop and len(seen) == needed:
            raise _StopForward

    return hook


def _process_layer(ctx: _Ctx, meta_layers, rotary, u: dict, hidden: _Store, chunks, bar) -> None:
    opts, li = ctx.opts, u["layer"]
    if TAP is not None:
        _tap("layer_input", layer=li, hidden=[hidden[i] for i in range(len(hidden))])
    with PHASES("build layer"):
        layer, routed, moe_attr = _build_layer(ctx, meta_layers, u)
    pre = f"{ctx.prefix}{li}."
    planned = {lin["module"]: lin for lin in u["linears"]}
    expert_mods = {m for m in planned if routed is not None and m.startswith(routed.ckpt_prefix)}
    dense = sorted(m for m in planned if m not in expert_mods)
    mods = dict(layer.named_modules())
    for m in dense:
        rel = _module_name(pre, m)
        if rel not in mods and rel.replace("block_sparse_moe.", "mlp.", 1) in mods:
            rel = rel.replace("block_sparse_moe.", "mlp.", 1)
        if not isinstance(mods.get(rel), torch.nn.Linear):
            raise CheckpointError(f"{m}: planned for quantization but the model has no linear of that name")
    rel_of = {
        m: (
            _module_name(pre, m)
            if _module_name(pre, m) in mods
            else _module_name(pre, m).replace("block_sparse_moe.", "mlp.", 1)
        )
        for m in dense
    }
    stages = _stages([rel_of[m] for m in dense], "experts" if expert_mods else None, opts["true_sequential"])
    by_rel = {v: k for k, v in rel_of.items()}
    hblock = opts["group_size"] if opts["hessian"] == "block" else None
    stats = _Stats(routed.n_experts) if routed is not None else None
    fam = _FAMILY_EXPERTS.get(ctx.family, _FAMILY_EXPERTS["generic"])
    routed_rows: _Store | None = None
    prune_now = routed is not None and ctx.pruning is not None and li not in ctx.bound
    if routed is not None and ctx.pruning is not None and li in ctx.bound:
        _apply_pruning(ctx, layer, routed, moe_attr, ctx.bound[li])  # chosen from a stats file
        stats = None
    stats_done = False
    if opts["method"] != "gptq":
        # No Hessians: one forward for the router statistics (and REAP), then the pruned layer.
        if stats is not None:
            _stats_pass(ctx, layer, routed, moe_attr, stats, hidden, chunks, rotary, li, not prune_now)
            if prune_now:
                _prune(ctx, layer, routed, moe_attr, li, stats)
        if stats is None or prune_now:
            _final_pass(
                ctx, layer, routed, hidden, chunks, rotary, li, "zero" if opts["sparse_forward"] else "run"
            )
        if stats is not None:
            ctx.stats[li] = stats
        del layer, routed
        return

    # the last stage holding an attention linear; the attention half is final after it
    attn_last = max(
        (si for si, st in enumerate(stages) if any(n.startswith("self_attn.") for n in st)), default=-1
    )
    residuals = _AttnResiduals(layer, hidden)
    for si, stage in enumerate(stages):
        lin = [s for s in stage if s != "<experts>"]
        collect = "<experts>" in stage
        if collect and prune_now:
            # The statistics of the unpruned layer (its inputs already through the quantized
            # stages before), then the layer pruned before its kept experts are solved.
            _stats_pass(ctx, layer, routed, moe_attr, stats, hidden, chunks, rotary, li, False, residuals)
            _prune(ctx, layer, routed, moe_attr, li, stats)
            stats_done = True
        hs: dict[str, _Hessian] = {}
        handles = []
        seen_in: dict[str, torch.Tensor] = {}
        aliases: dict[str, str | None] = {}
        for rel in lin:
            mod = mods[rel]
            hs[rel] = _Hessian(mod.in_features, ctx.device, hblock)
            handles.append(
                mod.register_forward_pre_hook(_input_hook(hs, rel, seen_in, aliases, len(lin), not collect))
            )
        if routed is not None:
            routed.mode = "collect" if collect else "zero"
            routed.collected = (
                _Collected(sum(c.numel() for c in chunks), ctx.cfg.hidden_size, ctx.dtype, ctx.device)
                if collect
                else None
            )
        gate_hook = None
        if collect and routed is not None and stats is not None and not stats_done:
            gate_mod = getattr(layer, moe_attr).gate

            def ghook(_m, _a, out):
                logits, _, idx = out
                stats.add_routing(logits, idx, fam.scoring)

            gate_hook = gate_mod.register_forward_hook(ghook)
        recording = si > attn_last and residuals.start()
        try:
            for ci in range(len(chunks)):
                seen_in.clear()
                try:
                    with torch.no_grad(), PHASES("forward"):
                        residuals.forward(ci, rotary)
                except _StopForward:
                    pass
        finally:
            for hd in handles:
                hd.remove()
            if gate_hook is not None:
                gate_hook.remove()
            if recording:
                residuals.stop()
        seen_in.clear()
        # Solve the stage's dense linears; same-input linears (q_a/kv_a, gate/up) are solved
        # separately with their shared Hessian, since GPTQ rows are independent.
        for rel in lin:
            mod = mods[rel]
            name = by_rel[rel]
            h = hs[rel]
            w = mod.weight.data
            hf = h.full() / max(h.tokens, 1)
            _tap("hessian", module=name, hessian=hf, tokens=h.tokens)
            s = _solve(w, hf, opts, h.tokens, None)
            report_errors([(w, s, hf)])
            with PHASES("pack+write"):
                ctx.sess.write_linear(name, _to_host(s.codes), _to_host(s.qmeta))
            mod.weight.data = s.deq.to(w.device, w.dtype)
            ctx.report.append({"layer": li, "module": name, **s.info})
        del hs
        if collect and routed is not None:
            with PHASES("experts: gather + forward"):
                routed_rows = _solve_experts(ctx, routed, u, None if stats_done else stats, fam, hblock, bar)
            routed.collected = None

    # Final pass: the next layer's inputs (routed output replayed when computed expert-major).
    mode = "run"
    if routed is not None:
        if routed_rows is not None and opts["true_sequential"]:
            mode = "replay"
            routed.replay_rows = routed_rows
            routed.replay_at = 0
        else:
            # REAP is recorded once: by the statistics pass or the experts' output pass.
            routed.stats = stats if routed_rows is None and not stats_done else None
    _final_pass(ctx, layer, routed, hidden, chunks, rotary, li, mode, residuals)
    if stats is not None:
        ctx.stats[li] = stats
    del layer, routed


def _forward_chunks(
    layer,
    hidden: _Store,
    chunks,
    rotary,
    li: int,
    phase: str,
    store: bool,
    residuals: _AttnResiduals | None = None,
) -> None:
    """Runs the layer over every calibration chunk (NaN/Inf refused); with ``store`` its outputs
    replace the chunks as the next layer's inputs. Chunks whose attention residual
    ``residuals`` holds skip the attention."""
    with torch.no_grad():
        for ci in range(len(chunks)):
            with PHASES(phase):
                out = residuals.forward(ci, rotary) if residuals else _forward(layer, hidden[ci], rotary)
            if not _all_finite(out):
                raise InvalidValueError(
                    f"layer {li}: the forward produced NaN or Inf (calibration chunk {ci})"
                )
            if store:
                with PHASES("store activations"):
                    hidden[ci] = out


def _final_pass(
    ctx: _Ctx,
    layer,
    routed,
    hidden: _Store,
    chunks,
    rotary,
    li: int,
    mode: str,
    residuals: _AttnResiduals | None = None,
) -> None:
    """Runs the layer over every chunk; its outputs become the next layer's inputs."""
    if routed is not None:
        routed.mode = mode
    _forward_chunks(layer, hidden, chunks, rotary, li, "forward", True, residuals)
    if routed is not None:
        routed.stats = None


def _scoring(family: str) -> str:
    return _FAMILY_EXPERTS.get(family, _FAMILY_EXPERTS["generic"]).scoring


def _stats_pass(
    ctx: _Ctx,
    layer,
    routed,
    moe_attr: str,
    stats: _Stats,
    hidden: _Store,
    chunks,
    rotary,
    li: int,
    store: bool,
    residuals: _AttnResiduals | None = None,
) -> None:
    """One forward of the (unpruned) layer over every chunk, recording the router statistics:
    routed-token counts and probability mass from the router's own output, REAP sums from the
    routed experts' outputs. With ``sparse_forward`` the routed experts are skipped (no REAP).
    With ``store`` its outputs become the next layer's inputs."""
    scoring = _scoring(ctx.family)
    routed.mode = "zero" if ctx.opts["sparse_forward"] else "run"
    routed.stats = stats
    gate = getattr(layer, moe_attr).gate

    def hook(_m, _a, out):
        logits, _, idx = out
        stats.add_routing(logits, idx, scoring)

    handle = gate.register_forward_hook(hook)
    try:
        _forward_chunks(layer, hidden, chunks, rotary, li, "forward (router statistics)", store, residuals)
    finally:
        handle.remove()
        routed.stats = None


def _prune(ctx: _Ctx, layer, routed, moe_attr: str, li: int, stats: _Stats) -> None:
    """Chooses the layer's kept experts from its statistics (``forge._native.select_experts``,
    the one implementation of the criteria), binds them in the session, and prunes the layer."""
    p = ctx.pruning
    keep = _native.select_experts(
        stats.counts.tolist(),
        stats.mass.tolist(),
        stats.reap.tolist(),
        p["criterion"],
        int(p["keep"][li]),
        int(p["n_group"]) if p["layout"] == "compact" else 1,
        int(ctx.opts["seed"]),
        li,
    )
    ctx.sess.bind_experts(li, keep)
    ctx.bound[li] = list(keep)
    _apply_pruning(ctx, layer, routed, moe_attr, keep)


def _apply_pruning(ctx: _Ctx, layer, routed, moe_attr: str, keep: list[int]) -> None:
    """Makes the built layer the pruned model's layer. Compact: the router's rows (and
    DeepSeek's ``e_score_correction_bias``) sliced to the kept experts, so routing picks the
    top-k among the survivors, exactly what the written checkpoint does in vLLM and
    transformers. Remap: the full router, picks of pruned experts dropped (weight 0, the rest
    rescaled), as forge's vLLM plugin does."""
    n = routed.n_experts
    if ctx.pruning["layout"] == "compact":
        gate = getattr(layer, moe_attr).gate
        if not (isinstance(getattr(gate, "weight", None), torch.Tensor) and hasattr(gate, "num_experts")):
            raise CheckpointError(
                f"{type(gate).__name__}: forge does not know how to prune this router (it needs a "
                "[experts, hidden] weight and num_experts); use remap=True"
            )
        ix = torch.tensor(keep, device=gate.weight.device)
        gate.weight = torch.nn.Parameter(gate.weight.data.index_select(0, ix), requires_grad=False)
        bias = getattr(gate, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            gate.e_score_correction_bias = bias.index_select(0, ix.to(bias.device))
        gate.num_experts = len(keep)
    else:
        m = torch.full((n,), -1, dtype=torch.long)
        m[torch.tensor(keep)] = torch.arange(len(keep))
        routed.remap = m.to(ctx.device)  # on the compute device once, not per forward
    routed.keep(list(keep))


def _expert_chunk(device: torch.device, d: int, inter: int) -> int:
    """Experts solved together: their Hessians with the stacked copy, the factors and the
    preparation's working memory (about 5 of the batch's Hessians at peak), plus weights and
    grids, must fit in half the GPU memory torch can still hand out."""
    if device.type != "cuda":
        return 4
    free = _gpu_room(device)
    per = 5 * 4 * (d * d + inter * inter) + 64 * d * inter
    return int(max(1, min(64, 0.5 * free // per)))


GATHER_ROWS = 65536
"""Routed-token rows gathered at a time for an expert's Hessians (a fixed count, so results do
not depend on free memory)."""

OUTPUT_WINDOW = 131072
"""Tokens whose routed output is accumulated at a time expert by expert (fp32, ``OUTPUT_WINDOW x
hidden``: 3.8 GB for DeepSeek-V3) after the experts are solved; fixed for the same reason.
Larger windows give the experts' GEMMs more rows: 2M tokens x top-8 over 256 experts on an H200
took 3.94 s with 65536 and 3.69 s with 131072 (262144: 3.64 s, for twice the memory)."""

GROUPED_WINDOW = 32768
"""Tokens whose routed output is computed at a time by grouped GEMMs (their pairs' gathered
inputs, hidden activations and outputs, bf16: ~11 GB for DeepSeek-V3 at top-8)."""


def _solve_group(items: list[dict], key: str, opts: dict) -> None:
    """Solves ``item[key + "_w"]`` with ``item[key + "_h"]`` for every item, GPTQ ones batched."""
    gptq = [it for it in items if it[key + "_h"] is not None]
    if gptq:
        res = _solve_batch(
            torch.stack([it[key + "_w"] for it in gptq]),
            torch.stack([it[key + "_h"] for it in gptq]),
            opts,
            [it["n"] for it in gptq],
            [it["fallback"] for it in gptq],
        )
        for it, r in zip(gptq, res, strict=True):
            it[key] = r
    for it in items:
        if it[key + "_h"] is None:
            it[key] = _solve(it[key + "_w"], None, opts, it["n"], it["fallback"])
    report_errors([(it[key + "_w"], it[key], it[key + "_h"]) for it in items])


def _solve_experts(
    ctx: _Ctx, routed: _RoutedExperts, u: dict, stats: _Stats | None, fam: _Experts, hblock, bar
) -> torch.Tensor:
    """GPTQ of every routed expert over exactly its routed tokens, in batches of experts; then
    the layer's routed output (router weight times expert output, summed in fp32) for every
    calibration token, written over the collected inputs and returned. Memory beyond the
    collected inputs is bounded: rows are gathered ``GATHER_ROWS`` at a time, the output is
    accumulated ``OUTPUT_WINDOW`` tokens at a time. Packing and writing run on a worker thread,
    overlapping the GPU."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    opts, li, dev = ctx.opts, u["layer"], ctx.device
    col = routed.collected
    assert col is not None
    xs = col.x
    idx, wts = torch.cat(col.ids), torch.cat(col.weights)
    t, k = idx.shape
    d = xs.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens ascending within one
    counts = torch.bincount(flat, minlength=routed.n_experts)[: routed.n_experts].tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    thr = opts["few_tokens_threshold"]
    thr = max(1, d // 8 if thr is None else thr)
    inter = routed.gate_up.shape[1] // 2
    planned = {lin["module"] for lin in u["linears"]}
    pooled: dict[str, torch.Tensor] = {}

    def gathered(sel: torch.Tensor):
        """The inputs of pairs ``sel``, ``GATHER_ROWS`` at a time."""
        for r0 in range(0, sel.numel(), GATHER_ROWS):
            yield col.rows(sel[r0 : r0 + GATHER_ROWS] // k, dev)

    def hess(parts, dim: int) -> torch.Tensor:
        hh = _Hessian(dim, dev, hblock)
        for x in parts:
            hh.add(x)
        return hh.full() / max(hh.tokens, 1)

    def pooled_gu() -> torch.Tensor:
        if "gu" not in pooled:
            pooled["gu"] = hess(gathered(torch.arange(t, device=dev) * k), d)
        return pooled["gu"]

    def ref() -> torch.Tensor:
        return col.rows(torch.arange(min(t, max(4 * thr, 1024)), device=dev), dev)

    chunk = _expert_chunk(dev, d, inter)
    pbar = tqdm(total=routed.n_experts, desc=f"layer {li} experts", leave=False, disable=not opts["progress"])
    writes = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for c0 in range(0, routed.n_experts, chunk):
            items = []
            for e in range(c0, min(routed.n_experts, c0 + chunk)):
                sel = order[starts[e] : starts[e + 1]]
                it = {"e": e, "sel": sel, "n": int(sel.numel())}
                it["fallback"] = opts["few_tokens"] if it["n"] < thr else None
                it["gu_w"] = routed.gate_up[e]
                if it["fallback"] == "pooled":
                    it["gu_h"] = pooled_gu()
                elif it["fallback"] == "rtn":
                    it["gu_h"] = None
                else:
                    it["gu_h"] = hess(gathered(sel), d)
                base = f"{routed.ckpt_prefix}{e}."
                if it["gu_h"] is not None:
                    _tap("hessian", module=f"{base}{fam.gate}+{fam.up}", hessian=it["gu_h"], tokens=it["n"])
                items.append(it)
            _solve_group(items, "gu", opts)
            for it in items:
                e = it["e"]
                routed.gate_up[e].copy_(it["gu"].deq)  # it["gu_w"] was this view: done with
                del it["gu_h"], it["gu_w"]
                it["d_w"] = routed.down[e]
                if it["fallback"] == "pooled":
                    it["d_h"] = hess([routed.hidden(e, ref())], inter)
                elif it["fallback"] == "rtn":
                    it["d_h"] = None
                else:
                    it["d_h"] = hess((routed.hidden(e, x) for x in gathered(it["sel"])), inter)
                if it["d_h"] is not None:
                    base = f"{routed.ckpt_prefix}{e}."
                    _tap("hessian", module=f"{base}{fam.down}", hessian=it["d_h"], tokens=it["n"])
            _solve_group(items, "d", opts)
            for it in items:
                e, s_gu, s_d = it["e"], it["gu"], it["d"]
                routed.down[e].copy_(s_d.deq)
                del it["d_w"]
                base = f"{routed.ckpt_prefix}{e}."
                for leaf, codes, qmeta in (
                    (fam.gate, s_gu.codes[:, :inter], s_gu.qmeta[:inter]),
                    (fam.up, s_gu.codes[:, inter:], s_gu.qmeta[inter:]),
                    (fam.down, s_d.codes, s_d.qmeta),
                ):
                    if base + leaf in planned:
                        with PHASES("copy to host"):
                            c_host, q_host = _to_host(codes), _to_host(qmeta)
                        writes.append(pool.submit(ctx.sess.write_linear, base + leaf, c_host, q_host))
                for leaf, s in ((f"{fam.gate}+{fam.up}", s_gu), (fam.down, s_d)):
                    ctx.report.append({"layer": li, "module": base + leaf, "expert": e, **s.info})
            pbar.update(len(items))
            del items
        _routed_output(routed, xs, idx, wts, dev, stats)
        with PHASES("pack+write (waiting)"):
            for f in writes:
                f.result()
    pbar.close()
    return xs


def _routed_output(
    routed: _RoutedExperts,
    xs: torch.Tensor,
    idx: torch.Tensor,
    wts: torch.Tensor,
    dev: torch.device,
    stats: _Stats | None,
) -> None:
    """The quantized experts' routed output over every collected token ``xs`` (routed to
    ``idx`` with weights ``wts``), ``GROUPED_WINDOW`` or ``OUTPUT_WINDOW`` tokens at a time on
    ``dev`` (:meth:`_RoutedExperts.compute` on the window), written over the window's inputs; REAP
    sums into ``stats``."""
    routed.stats = stats
    window = GROUPED_WINDOW if routed.grouped(dev, xs.dtype) else OUTPUT_WINDOW
    try:
        for w0 in range(0, xs.shape[0], window):
            w = slice(w0, w0 + window)
            xs[w].copy_(routed.compute(xs[w].to(dev, non_blocking=True), idx[w], wts[w]))
    finally:
        routed.stats = None


# --------------------------------------------------------------------------------------
# Reports


def _reports(ctx: _Ctx, summary: dict, notes: list[str]) -> list[tuple[str, bytes]]:
    rows = ctx.report
    files: list[tuple[str, bytes]] = []
    summary_json = {
        "arch": summary["arch"],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in ctx.opts.items()},
        "notes": notes,
        "linears": rows,
        "layer_seconds": {str(k): v for k, v in ctx.layer_seconds.items()},
        "phase_seconds": dict(PHASES.seconds),
    }
    files.append(("forge/report.json", (json.dumps(summary_json, indent=1) + "\n").encode()))
    lines = [
        f"# 4bit-forge {'router statistics' if ctx.opts['stats_only'] else ctx.opts['method'].upper()} report",
        "",
        f"Family `{summary['arch']}`, group size {ctx.opts['group_size']}, grid `{ctx.opts['grid']}`, "
        f"{ctx.opts['nsamples']} x {ctx.opts['seqlen']} calibration tokens, damp {ctx.opts['damp']}, "
        f"act_order {ctx.opts['act_order']}, hessian `{ctx.opts['hessian']}`.",
        "",
    ]
    lines += [f"- {n}" for n in notes]
    fb = [r for r in rows if r.get("fallback")]
    lines += ["", f"{len(rows)} solves, {len(fb)} with a few-token fallback.", ""]
    lines += [
        "| layer | module | tokens | method | fallback | damp | retries | err GPTQ | err RTN | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v):
        return "" if v is None else (f"{v:.3e}" if isinstance(v, float) else str(v))

    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['module']} | {r['tokens']} | {r['method']} | {r.get('fallback') or ''} | "
            f"{f(r.get('damp'))} | {r.get('retries', 0)} | {f(r.get('err_gptq'))} | {f(r.get('err_rtn'))} | {r['seconds']:.2f} |"
        )
    files.append(("forge/report.md", ("\n".join(lines) + "\n").encode()))
    png = _error_plot(rows)
    if png is not None:
        files.append(("forge/report.png", png))
    if ctx.stats:
        from safetensors.torch import save

        layers = sorted(ctx.stats)
        t = {
            "layers": torch.tensor(layers, dtype=torch.int64),
            "counts": torch.stack([ctx.stats[i].counts for i in layers]),
            "mass": torch.stack([ctx.stats[i].mass for i in layers]),
            "reap": torch.stack([ctx.stats[i].reap for i in layers]),
        }
        files.append(
            (
                "forge/router_stats.safetensors",
                save(
                    t,
                    # one key: safetensors writes metadata in no fixed order
                    metadata={
                        "forge": json.dumps(
                            {
                                "format": "4bit-forge router stats v1",
                                "scoring": _scoring(ctx.family),
                                "num_experts": int(ctx.stats[layers[0]].n),
                                "model": str(getattr(ctx.cfg, "model_type", "")),
                            },
                            sort_keys=True,
                        )
                    },
                ),
            )
        )
        js = {
            str(i): {
                "counts": ctx.stats[i].counts.tolist(),
                "mass": ctx.stats[i].mass.tolist(),
                "reap_mean": (ctx.stats[i].reap / ctx.stats[i].counts.clamp(min=1)).tolist(),
            }
            for i in layers
        }
        files.append(("forge/router_stats.json", (json.dumps(js) + "\n").encode()))
        from .prune import stats_heatmap

        png = stats_heatmap(ctx.stats, ctx.bound)
        if png is not None:
            files.append(("forge/router_stats.png", png))
    return files


def _error_plot(rows: list[dict]) -> bytes | None:
    """Per-layer mean relative output error (GPTQ vs RTN) as a PNG, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layers = sorted({r["layer"] for r in rows if r.get("err_gptq") is not None})
    if not layers:
        return None

    def mean(key: str, li: int) -> float:
        v = [r[key] for r in rows if r["layer"] == li and r.get(key) is not None]
        return sum(v) / len(v) if v else math.nan

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(layers, [mean("err_rtn", i) for i in layers], "o-", label="RTN (same grid)")
    ax.plot(layers, [mean("err_gptq", i) for i in layers], "o-", label="GPTQ")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean ‖X(W−Ŵ)‖² / ‖XW‖²")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
