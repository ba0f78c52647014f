//! The CUDA side of the functional API: a CUDA tensor goes to the kernels of `forge-cuda`
//! on PyTorch's current stream, with outputs from PyTorch's allocator. Same arguments,
//! same results as the CPU path (bit-exact for integer outputs).

use crate::errors::raise;
use crate::tensor::{empty_on, DType, Tensor};
use forge_core::grid::{GridMode, GridSpec};
use forge_cuda::{ops as cu, CudaError};
use pyo3::prelude::*;

/// Maps a CUDA error to its Python exception.
pub fn cuda_err(py: Python<'_>, e: CudaError) -> PyErr {
    let class = match &e {
        CudaError::NoDriver(_) | CudaError::NoNvrtc(_) | CudaError::NoDevice { .. } => {
            "CudaUnavailableError"
        }
        CudaError::InvalidArgument { .. } => "InvalidValueError",
        _ => "KernelError",
    };
    raise(py, class, e.to_string())
}

/// PyTorch's current stream on the tensor's device.
pub fn stream_of(t: &Tensor<'_>) -> PyResult<cu::Stream> {
    let py = t.obj.py();
    let handle: u64 = py
        .import("torch")?
        .getattr("cuda")?
        .call_method1("current_stream", (t.obj.getattr("device")?,))?
        .getattr("cuda_stream")?
        .extract()?;
    Ok(cu::Stream {
        device: t.index,
        handle,
    })
}

fn cu_dtype(t: &Tensor<'_>) -> cu::DType {
    cu_of(t.dtype)
}

/// The kernels' element type of a floating boundary type (the 16- and 32-bit ones; the rest
/// are FP8 bytes).
fn cu_of(d: DType) -> cu::DType {
    match d {
        DType::F32 => cu::DType::F32,
        DType::F16 => cu::DType::F16,
        DType::BF16 => cu::DType::Bf16,
        _ => cu::DType::F8E4M3,
    }
}

/// The kernels' element type of a floating torch dtype named `torch_dtype` (`str(tensor.dtype)`:
/// "torch.float32", "torch.float16" or "torch.bfloat16"), else a DTypeError naming `what`.
fn float_dtype(py: Python<'_>, what: &str, torch_dtype: &str) -> PyResult<cu::DType> {
    match DType::from_torch(torch_dtype) {
        Some(d @ (DType::F32 | DType::BF16 | DType::F16)) => Ok(cu_of(d)),
        _ => Err(raise(
            py,
            "DTypeError",
            format!("{what}: expected torch.float32, torch.float16 or torch.bfloat16, got {torch_dtype}"),
        )),
    }
}

/// Range (and MSE) grid of a CUDA weight `(rows, cols)`, FP8 with its checked block scales if
/// given.
pub fn build_quant_grid<'py>(
    w: &Tensor<'py>,
    block_scale: Option<&Tensor<'py>>,
    spec: &GridSpec,
    mode: GridMode,
) -> PyResult<Bound<'py, PyAny>> {
    let py = w.obj.py();
    w.require_finite_cuda()?;
    let (rows, cols) = (w.shape[0], w.shape[1]);
    let (out, ptr) = empty_on(py, &[rows, spec.groups(cols), 4], DType::U8, w)?;
    let grid = cu::QmetaGrid {
        x: w.ptr as u64,
        dtype: cu_dtype(w),
        rows,
        cols,
        spec: *spec,
        qmeta: ptr,
        block_scale: block_scale.map_or(0, |b| b.ptr as u64),
    };
    let s = stream_of(w)?;
    // SAFETY: pointers from live CUDA tensors of the checked shapes and dtypes.
    unsafe {
        cu::qmeta_range(&grid, s).map_err(|e| cuda_err(py, e))?;
        if let GridMode::Mse(m) = mode {
            cu::qmeta_mse(&grid, &m, s).map_err(|e| cuda_err(py, e))?;
        }
    }
    Ok(out)
}

type Three<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>);

/// The AWQ tensors of an `n × k` linear, allocated on `like`'s device.
fn awq_outputs<'py>(
    like: &Tensor<'py>,
    n: usize,
    k: usize,
    g: usize,
) -> PyResult<(Three<'py>, cu::PackedOut)> {
    let py = like.obj.py();
    let (qw, qweight) = empty_on(py, &[k, n / 8], DType::I32, like)?;
    let (qz, qzeros) = empty_on(py, &[k / g, n / 8], DType::I32, like)?;
    let (sc, scales) = empty_on(py, &[k / g, n], DType::F16, like)?;
    let ptrs = cu::PackedOut {
        qweight,
        qzeros,
        scales,
    };
    Ok(((qw, qz, sc), ptrs))
}

/// Fused quantize + AWQ pack of a CUDA weight `(N, K)`, FP8 with its checked block scales if
/// given.
pub fn quantize_pack_awq<'py>(
    w: &Tensor<'py>,
    qmeta: &Tensor<'py>,
    block_scale: Option<&Tensor<'py>>,
    spec: &GridSpec,
) -> PyResult<Three<'py>> {
    let py = w.obj.py();
    qmeta.require_same_device(w)?;
    let (n, k) = (w.shape[0], w.shape[1]);
    let (out, ptrs) = awq_outputs(w, n, k, spec.group_size)?;
    let args = cu::QuantizePack {
        w: w.ptr as u64,
        dtype: cu_dtype(w),
        n,
        k,
        qmeta: qmeta.ptr as u64,
        spec: *spec,
        block_scale: block_scale.map_or(0, |b| b.ptr as u64),
    };
    let s = stream_of(w)?;
    // SAFETY: live CUDA tensors of checked shapes.
    unsafe { cu::awq_quantize_pack(&args, &ptrs, s) }.map_err(|e| cuda_err(py, e))?;
    Ok(out)
}

/// AWQ pack of CUDA codes `(K, N)`.
pub fn pack_awq<'py>(
    codes: &Tensor<'py>,
    qmeta: &Tensor<'py>,
    spec: &GridSpec,
) -> PyResult<Three<'py>> {
    let py = codes.obj.py();
    qmeta.require_same_device(codes)?;
    let (k, n) = (codes.shape[0], codes.shape[1]);
    let maxq: u8 = codes
        .obj
        .call_method0("max")?
        .call_method0("item")?
        .extract()?;
    if maxq > 15 {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("codes: must be <= 15, found {maxq}"),
        ));
    }
    let (out, ptrs) = awq_outputs(codes, n, k, spec.group_size)?;
    let args = cu::PackCodes {
        codes: codes.ptr as u64,
        qmeta: qmeta.ptr as u64,
        n,
        k,
        spec: *spec,
    };
    let s = stream_of(codes)?;
    // SAFETY: live CUDA tensors of checked shapes.
    unsafe { cu::awq_pack_codes(&args, &ptrs, s) }.map_err(|e| cuda_err(py, e))?;
    Ok(out)
}

/// W4A16 GEMM on CUDA: `x (M, K)` f16/bf16 → `y (M, N)` of the same dtype.
pub fn awq_matmul<'py>(
    x: &Tensor<'py>,
    qweight: &Tensor<'py>,
    qzeros: &Tensor<'py>,
    scales: &Tensor<'py>,
    k: usize,
    n: usize,
    g: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.obj.py();
    for t in [qweight, qzeros, scales] {
        t.require_same_device(x)?;
    }
    x.require_dtype(&[DType::F16, DType::BF16])?;
    let m = x.shape[0];
    let (y, yp) = empty_on(py, &[m, n], x.dtype, x)?;
    let s = stream_of(x)?;
    // split-K scratch from PyTorch's caching allocator (cheap, and legal in CUDA graphs)
    let ws_bytes = cu::w4a16_workspace_bytes(x.index, m, n, k, g).map_err(|e| cuda_err(py, e))?;
    let (_ws, wsp) = if ws_bytes > 0 {
        empty_on(py, &[ws_bytes], DType::U8, x)?
    } else {
        (py.None().into_bound(py), 0)
    };
    let args = cu::W4a16Gemm {
        x: x.ptr as u64,
        act: cu_dtype(x),
        m,
        n,
        k,
        group_size: g,
        qweight: qweight.ptr as u64,
        qzeros: qzeros.ptr as u64,
        scales: scales.ptr as u64,
        y: yp,
        workspace: wsp,
        workspace_bytes: ws_bytes,
    };
    // SAFETY: live CUDA tensors of checked shapes; workspace of the size asked for.
    unsafe { cu::w4a16_gemm_awq(&args, s) }.map_err(|e| cuda_err(py, e))?;
    Ok(y)
}

/// Batched GPTQ solve on CUDA: `w (E, C, R)` f32 (updated in place), `u (E, C, C)`,
/// `qmeta (E, R, G, 4)`, `perm (E, C)` int32 or None; returns codes `(E, C, R)` uint8.
#[allow(clippy::too_many_arguments)]
pub fn gptq_solve<'py>(
    w: &Tensor<'py>,
    u: &Tensor<'py>,
    qmeta: &Tensor<'py>,
    perm: Option<&Tensor<'py>>,
    experts: usize,
    c: usize,
    r: usize,
    spec: &GridSpec,
    block_size: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let py = w.obj.py();
    u.require_same_device(w)?;
    qmeta.require_same_device(w)?;
    let (codes, cp) = empty_on(py, &[experts, c, r], DType::U8, w)?;
    let (_ws, wsp) = empty_on(
        py,
        &[cu::gptq_workspace_bytes(experts, c, r, block_size) / 4],
        DType::F32,
        w,
    )?;
    let pp = perm.map_or(0, |p| p.ptr as u64);
    let s = stream_of(w)?;
    // SAFETY: live CUDA tensors of checked shapes.
    unsafe {
        cu::gptq_solve(
            &cu::GptqSolve {
                w: w.ptr as u64,
                u: u.ptr as u64,
                qmeta: qmeta.ptr as u64,
                perm: pp,
                codes: cp,
                err_ws: wsp,
                experts,
                c,
                r,
                spec: *spec,
                block_size,
            },
            s,
        )
    }
    .map_err(|e| cuda_err(py, e))?;
    Ok(codes)
}

/// `h (D, D) += alpha · xᵀx` on CUDA.
pub fn hessian_update(h: &Tensor<'_>, x: &Tensor<'_>, alpha: f32) -> PyResult<()> {
    let py = h.obj.py();
    x.require_same_device(h)?;
    let (t, d) = (x.shape[0], x.shape[1]);
    let s = stream_of(h)?;
    let a = cu::HessianUpdate {
        x: x.ptr as u64,
        dtype: cu_dtype(x),
        d,
        rows: cu::HessianRows::All { t },
        h: h.ptr as u64,
        alpha,
        overwrite: false,
        kernel: cu::HessianKernel::Auto,
    };
    // SAFETY: live CUDA tensors of checked shapes.
    unsafe { cu::hessian_update(&a, s) }.map_err(|e| cuda_err(py, e))
}

/// The kernel [`hessian_update`] runs for `h` and `x`.
pub fn hessian_kernel(h: &Tensor<'_>, x: &Tensor<'_>) -> PyResult<&'static str> {
    let s = stream_of(h)?;
    let k = cu::hessian_kernel(cu_dtype(x), x.shape[1], x.ptr as u64, h.ptr as u64, s)
        .map_err(|e| cuda_err(h.obj.py(), e))?;
    Ok(match k {
        cu::HessianKernel::Wgmma => "wgmma",
        cu::HessianKernel::MmaSync => "mma_sync",
        _ => "simt",
    })
}

/// Segmented per-expert Hessians on CUDA, added (or written fresh with `overwrite`).
pub fn hessian_update_segmented(
    h: &Tensor<'_>,
    x: &Tensor<'_>,
    idx: &Tensor<'_>,
    offsets: &Tensor<'_>,
    experts: usize,
    alpha: f32,
    overwrite: bool,
) -> PyResult<()> {
    let py = h.obj.py();
    for t in [x, idx, offsets] {
        t.require_same_device(h)?;
    }
    let d = x.shape[1];
    let s = stream_of(h)?;
    let a = cu::HessianUpdate {
        x: x.ptr as u64,
        dtype: cu_dtype(x),
        d,
        rows: cu::HessianRows::Routed {
            idx: idx.ptr as u64,
            offsets: offsets.ptr as u64,
            experts,
        },
        h: h.ptr as u64,
        alpha,
        overwrite,
        kernel: cu::HessianKernel::Auto,
    };
    // SAFETY: live CUDA tensors of checked shapes; indices validated by the caller.
    unsafe { cu::hessian_update(&a, s) }.map_err(|e| cuda_err(py, e))
}

/// `forge.cuda_status()`: whether the CUDA path is usable, and why not.
#[pyfunction]
pub fn cuda_status(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let st = py.detach(forge_cuda::status);
    let d = pyo3::types::PyDict::new(py);
    d.set_item("available", st.available)?;
    d.set_item("reason", st.reason)?;
    d.set_item("device_name", st.device_name)?;
    d.set_item("compute_capability", st.compute_capability)?;
    d.set_item("nvrtc_version", st.nvrtc_version)?;
    d.set_item("device_count", st.device_count)?;
    Ok(d.into_any())
}

/// Bytes of split-K scratch the W4A16 GEMM needs for `(M, N, K, G)` on CUDA device
/// `device` (0 when K is not split). Served from the plan cache after the first call.
#[pyfunction]
pub fn w4a16_workspace_bytes(
    py: Python<'_>,
    device: usize,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> PyResult<usize> {
    cu::w4a16_workspace_bytes(device, m, n, k, group_size).map_err(|e| cuda_err(py, e))
}

/// What the W4A16 GEMM launches for `(M, N, K, G)` with bf16 (else fp16) activations on CUDA
/// device `device`: kernel, grid and K splits, in words (benches and tuning).
#[pyfunction]
pub fn w4a16_plan(
    py: Python<'_>,
    device: usize,
    bf16: bool,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> PyResult<String> {
    cu::w4a16_plan(device, act_dtype(bf16), m, n, k, group_size).map_err(|e| cuda_err(py, e))
}

/// The W4A16 launches' activation dtype (the bindings take `bf16: bool`; else fp16).
fn act_dtype(bf16: bool) -> cu::DType {
    if bf16 {
        cu::DType::Bf16
    } else {
        cu::DType::F16
    }
}

/// The launch stream of a raw-pointer binding: torch's `cuda_stream` handle on `device`.
fn torch_stream(device: usize, handle: u64) -> cu::Stream {
    cu::Stream { device, handle }
}

/// Refuses a launch without split-K scratch when its plan needs some (`need`): the kernels
/// never fall back to a driver allocation outside torch's caching allocator.
fn require_workspace(
    py: Python<'_>,
    workspace: u64,
    need: impl FnOnce() -> Result<usize, CudaError>,
) -> PyResult<()> {
    if workspace != 0 {
        return Ok(());
    }
    let need = need().map_err(|e| cuda_err(py, e))?;
    if need > 0 {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("workspace: {need} bytes of split-K scratch needed, got none"),
        ));
    }
    Ok(())
}

/// The W4A16 GEMM launch behind `forge::awq_gemm`, on plain integers: device pointers
/// (`data_ptr()`), the raw stream handle (`torch.cuda.current_stream().cuda_stream`) and
/// sizes. Nothing is allocated, read back or looked up in Python here: the caller allocates
/// `y` (and the split-K `workspace` of [`w4a16_workspace_bytes`]) with torch on that stream
/// and has checked dtypes, devices, shapes and contiguity; this checks sizes, alignment and
/// the workspace size, and launches asynchronously (legal under CUDA-graph capture).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn w4a16_launch(
    py: Python<'_>,
    x: u64,
    bf16: bool,
    m: usize,
    k: usize,
    n: usize,
    group_size: usize,
    qweight: u64,
    qzeros: u64,
    scales: u64,
    y: u64,
    workspace: u64,
    workspace_bytes: usize,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    require_workspace(py, workspace, || {
        cu::w4a16_workspace_bytes(device, m, n, k, group_size)
    })?;
    let args = cu::W4a16Gemm {
        x,
        act: act_dtype(bf16),
        m,
        n,
        k,
        group_size,
        qweight,
        qzeros,
        scales,
        y,
        workspace,
        workspace_bytes,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::w4a16_gemm_awq(&args, torch_stream(device, stream)) }.map_err(|e| cuda_err(py, e))
}

/// Repacks the AWQ `qweight [K, N/8]` at `qweight` into the tile layout at `out` (as many
/// words) on `stream` (see `forge_cuda::ops::w4a16_tile_repack`); the caller allocates `out`
/// with torch and has checked dtypes, devices and contiguity.
#[pyfunction]
pub fn w4a16_tile_repack_launch(
    py: Python<'_>,
    qweight: u64,
    out: u64,
    n: usize,
    k: usize,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    // SAFETY: the caller passes live device allocations of K·N/8 words on `device`.
    unsafe { cu::w4a16_tile_repack(qweight, out, n, k, torch_stream(device, stream)) }
        .map_err(|e| cuda_err(py, e))
}

/// Dequantizes the AWQ tensors at `qweight`, `qzeros`, `scales` (a linear of `n` out × `k`
/// in features, group `group_size`) into the dense row-major `out [K, N]` of `out_dtype`
/// (`str(tensor.dtype)`: "torch.float32", "torch.float16" or "torch.bfloat16") on `stream`
/// (see `forge_cuda::ops::awq_dequant`); the caller allocates `out` with torch and has
/// checked dtypes, devices, shapes and contiguity.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn awq_dequant_launch(
    py: Python<'_>,
    qweight: u64,
    qzeros: u64,
    scales: u64,
    out: u64,
    out_dtype: &str,
    n: usize,
    k: usize,
    group_size: usize,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    let out_dtype = float_dtype(py, "out", out_dtype)?;
    let args = cu::AwqDequant {
        n,
        k,
        group_size,
        qweight,
        qzeros,
        scales,
        out,
        out_dtype,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::awq_dequant(&args, torch_stream(device, stream)) }.map_err(|e| cuda_err(py, e))
}

/// The tiled W4A16 GEMV launch (`M <= 16`, codes in the tile layout; see
/// `forge_cuda::ops::w4a16_gemv_tiled`), on plain integers like [`w4a16_launch`]: no
/// workspace, asynchronous, legal under CUDA-graph capture.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn w4a16_tiled_launch(
    py: Python<'_>,
    x: u64,
    bf16: bool,
    m: usize,
    k: usize,
    n: usize,
    group_size: usize,
    qweight_tiled: u64,
    qzeros: u64,
    scales: u64,
    y: u64,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    let args = cu::TiledGemv {
        x,
        act: act_dtype(bf16),
        m,
        n,
        k,
        group_size,
        qweight_tiled,
        qzeros,
        scales,
        y,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::w4a16_gemv_tiled(&args, torch_stream(device, stream)) }
        .map_err(|e| cuda_err(py, e))
}

/// Bytes of split-K scratch the grouped MoE GEMV needs (see
/// `forge_cuda::ops::w4a16_grouped_workspace_bytes`); served from the plan cache after the
/// first call per shape.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn w4a16_grouped_workspace_bytes(
    py: Python<'_>,
    device: usize,
    rows: usize,
    pairs: usize,
    num_segments: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> PyResult<usize> {
    cu::w4a16_grouped_workspace_bytes(device, rows, pairs, num_segments, n, k, group_size)
        .map_err(|e| cuda_err(py, e))
}

/// Whether the tile layout and its GEMV take a linear of `n` out features, `k` in features
/// and group size `group_size` (see `forge_cuda::ops::tile_shape_ok`).
#[pyfunction]
pub fn tile_shape_ok(n: usize, k: usize, group_size: usize) -> bool {
    cu::tile_shape_ok(n, k, group_size)
}

/// Most rows per segment with which CUDA device `device` runs the grouped MoE product on
/// tensor cores for experts of `k` in features, `n` out features and group size `group_size`:
/// 256 (the wgmma kernel, sm_90), 64 (the mma.sync kernel, sm_80 and later) or 0 (see
/// `forge_cuda::ops::grouped_tc_max_rows`).
#[pyfunction]
pub fn grouped_tc_max_rows(
    py: Python<'_>,
    device: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> PyResult<usize> {
    cu::grouped_tc_max_rows(device, n, k, group_size).map_err(|e| cuda_err(py, e))
}

/// Whether the grouped GEMV (1, 2 or 4 rows a segment) takes experts of `k` in features, `n`
/// out features and group size `group_size` (see `forge_cuda::ops::grouped_gemv_shape_ok`).
#[pyfunction]
pub fn grouped_gemv_shape_ok(n: usize, k: usize, group_size: usize) -> bool {
    cu::grouped_gemv_shape_ok(n, k, group_size)
}

/// Rows of the grouped GEMV's segment table for `pairs` pairs over `experts` experts in
/// segments of at most `rows` (see `forge_cuda::ops::moe_max_segments`).
#[pyfunction]
pub fn moe_max_segments(pairs: usize, experts: usize, rows: usize) -> usize {
    cu::moe_max_segments(pairs, experts, rows)
}

/// The MoE routing launch (see `forge_cuda::ops::moe_route`) on plain integers: `ids`
/// (the router's top-k ids, int64 or int32, `pairs` of them), `order` / `tokens` (int32
/// `[pairs]`) and `segments` (int32 `[num_segments, 3]`), allocated by the caller with torch
/// on that stream; launched asynchronously (legal under CUDA-graph capture).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn moe_route_launch(
    py: Python<'_>,
    ids: u64,
    ids_i64: bool,
    pairs: usize,
    top_k: usize,
    experts: usize,
    rows: usize,
    order: u64,
    tokens: u64,
    segments: u64,
    num_segments: usize,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    let args = cu::MoeRoute {
        ids,
        ids_i64,
        pairs,
        top_k,
        experts,
        rows,
        order,
        tokens,
        segments,
        num_segments,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::moe_route(&args, torch_stream(device, stream)) }.map_err(|e| cuda_err(py, e))
}

/// The MoE top-k weighted sum launch (see `forge_cuda::ops::moe_combine`) on plain integers:
/// `y` (`[tokens·top_k, hidden]`, bf16 when `bf16` else f16), `weights` (`weights_dtype`:
/// `str(tensor.dtype)`, "torch.float32", "torch.bfloat16" or "torch.float16") and `ids` (int64 or int32), both
/// `[tokens, top_k]`, and `out` (`[tokens, hidden]`, y's type), allocated by the caller with
/// torch on that stream; launched asynchronously (legal under CUDA-graph capture).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn moe_combine_launch(
    py: Python<'_>,
    y: u64,
    bf16: bool,
    weights: u64,
    weights_dtype: &str,
    ids: u64,
    ids_i64: bool,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    experts: usize,
    out: u64,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    let weights_dtype = float_dtype(py, "weights", weights_dtype)?;
    let args = cu::MoeCombine {
        y,
        act: act_dtype(bf16),
        weights,
        weights_dtype,
        ids,
        ids_i64,
        tokens,
        top_k,
        hidden,
        experts,
        out,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::moe_combine(&args, torch_stream(device, stream)) }.map_err(|e| cuda_err(py, e))
}

/// The experts' activation launch (see `forge_cuda::ops::silu_mul`) on plain integers: `x`
/// (`[rows, 2·inter]`, gate columns then up columns, bf16 when `bf16` else f16) into `out`
/// (`[rows, inter]`, x's type), allocated by the caller with torch on that stream; launched
/// asynchronously (legal under CUDA-graph capture).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn silu_mul_launch(
    py: Python<'_>,
    x: u64,
    bf16: bool,
    rows: usize,
    inter: usize,
    out: u64,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    let args = cu::SiluMul {
        x,
        act: act_dtype(bf16),
        rows,
        inter,
        out,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`.
    unsafe { cu::silu_mul(&args, torch_stream(device, stream)) }.map_err(|e| cuda_err(py, e))
}

/// The grouped MoE GEMV launch behind `forge::awq_moe_gemv`, on plain integers like
/// [`w4a16_launch`]: `x` (activations, rows read through `x_rows`), `x_rows` / `out_rows`
/// (int32 `[pairs]`), `segments` (int32 `[num_segments, 3]`: first sorted position, row
/// count, expert id), the stacked AWQ tensors with their per-expert strides in elements,
/// `y [pairs, N]` and the split-K `workspace`. The caller allocates every buffer with torch
/// on that stream and has checked dtypes, devices and shapes; this checks sizes and
/// alignment and launches asynchronously (legal under CUDA-graph capture).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn w4a16_grouped_launch(
    py: Python<'_>,
    x: u64,
    bf16: bool,
    x_rows: u64,
    out_rows: u64,
    pairs: usize,
    segments: u64,
    num_segments: usize,
    rows: usize,
    experts: usize,
    k: usize,
    n: usize,
    group_size: usize,
    qweight: u64,
    qzeros: u64,
    scales: u64,
    expert_strides: [usize; 3],
    y: u64,
    workspace: u64,
    workspace_bytes: usize,
    device: usize,
    stream: u64,
) -> PyResult<()> {
    require_workspace(py, workspace, || {
        cu::w4a16_grouped_workspace_bytes(device, rows, pairs, num_segments, n, k, group_size)
    })?;
    let args = cu::GroupedGemv {
        x,
        act: act_dtype(bf16),
        x_rows,
        out_rows,
        pairs,
        segments,
        num_segments,
        rows,
        experts,
        k,
        n,
        group_size,
        qweight,
        qzeros,
        scales,
        expert_strides,
        y,
        workspace,
        workspace_bytes,
    };
    // SAFETY: the caller passes live device allocations of the documented sizes on `device`
    // and a segment table built from valid routing (positions < pairs, rows of x).
    unsafe { cu::w4a16_grouped_gemv_awq(&args, torch_stream(device, stream)) }
        .map_err(|e| cuda_err(py, e))
}
