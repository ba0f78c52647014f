//! The functional API of `forge._native`. Each function validates its tensors (dtype,
//! device, shape), converts them to slices without copying, runs the core without the
//! GIL and returns new torch tensors.

use crate::cuda_ops;
use crate::errors::{core_err, detach_guarded, raise};
use crate::tensor::{from_vec, DType, Tensor};
use forge_core::grid::{self, GridMode, GridSpec, MseSpec};
use forge_core::{gptq, matmul, pack, QMeta, F8E4M3};
use half::{bf16, f16};
use pyo3::prelude::*;

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::F8E4M3];

/// Runs `$body` with `$slice` bound to the weight data as its element type.
macro_rules! with_elements {
    ($t:expr, |$slice:ident| $body:expr) => {{
        // SAFETY: dtype checked against FLOATS, device checked to be CPU.
        match $t.dtype {
            DType::F32 => {
                let $slice: &[f32] = unsafe { $t.slice() };
                $body
            }
            DType::F16 => {
                let $slice: &[f16] = unsafe { $t.slice() };
                $body
            }
            DType::BF16 => {
                let $slice: &[bf16] = unsafe { $t.slice() };
                $body
            }
            _ => {
                let $slice: &[F8E4M3] = unsafe { $t.slice() };
                $body
            }
        }
    }};
    // With optional FP8 block scales (`&Option<Tensor>`): `$slice` is the weight dequantized
    // to f32 when they are given (`dequantized_cpu`), else its stored elements as above.
    ($py:expr, $t:expr, $scales:expr, |$slice:ident| $body:expr) => {{
        match $scales {
            Some(b) => {
                let v = dequantized_cpu($py, &$t, b)?;
                let $slice: &[f32] = &v;
                $body
            }
            None => with_elements!($t, |$slice| $body),
        }
    }};
}

/// Converts a Python integer argument to an unsigned size, naming it on failure.
pub fn size_arg(py: Python<'_>, name: &str, v: i64, min: i64, max: i64) -> PyResult<usize> {
    if v < min || v > max {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("{name}: must be between {min} and {max}, got {v}"),
        ));
    }
    Ok(v as usize)
}

fn spec(py: Python<'_>, bits: i64, group_size: usize, symmetric: bool) -> PyResult<GridSpec> {
    let bits = size_arg(py, "bits", bits, 2, 8)? as u8;
    let s = GridSpec {
        bits,
        group_size,
        symmetric,
    };
    s.validate().map_err(|e| core_err(py, e))?;
    Ok(s)
}

fn qmeta_vec(q: &Tensor<'_>) -> Vec<QMeta> {
    // SAFETY: caller checked dtype uint8 and last dim 4 on the CPU.
    let b: &[u8] = unsafe { q.slice() };
    b.chunks_exact(4)
        .map(|c| QMeta::from_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn qmeta_bytes(q: &[QMeta]) -> Vec<u8> {
    q.iter().flat_map(|m| m.to_bytes()).collect()
}

/// Checks a `(rows, groups, 4)` uint8 qmeta tensor.
fn check_qmeta(q: &Tensor<'_>, rows: usize, groups: usize, what: &str) -> PyResult<()> {
    q.require_cpu()?;
    q.require_dtype(&[DType::U8])?;
    q.require_shape(&[rows, groups, 4], what)
}

fn weight_2d<'py>(name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Tensor<'py>> {
    let t = Tensor::extract(name, obj)?;
    if !t.is_cuda() {
        t.require_cpu()?;
    }
    t.require_dtype(FLOATS)?;
    t.require_ndim(2, "(rows, cols)")?;
    Ok(t)
}

/// The optional `scale_inv` of an FP8 `weight (N, K)` (DeepSeek's `weight_scale_inv`):
/// float32 `(ceil(N/128), ceil(K/128))` on the weight's device, element `[r, c]` of the weight
/// being `e4m3(byte) · scale_inv[r / 128, c / 128]`. `check_finite`: refuse NaN or Inf scales.
fn block_scales<'py>(
    scale_inv: Option<&Bound<'py, PyAny>>,
    w: &Tensor<'py>,
    check_finite: bool,
) -> PyResult<Option<Tensor<'py>>> {
    let Some(obj) = scale_inv else {
        return Ok(None);
    };
    let s = Tensor::extract("scale_inv", obj)?;
    if w.dtype != DType::F8E4M3 {
        return Err(raise(
            w.obj.py(),
            "DTypeError",
            format!(
                "scale_inv: block scales apply to a torch.float8_e4m3fn weight, got torch.{}",
                w.dtype.torch_name()
            ),
        ));
    }
    s.require_same_device(w)?;
    s.require_dtype(&[DType::F32])?;
    let b = forge_core::dtype::FP8_BLOCK;
    s.require_shape(
        &[w.shape[0].div_ceil(b), w.shape[1].div_ceil(b)],
        "(ceil(N/128), ceil(K/128)) for weight (N, K)",
    )?;
    // Unchecked when the caller built the grid from the same weight and scales (it checked).
    if check_finite {
        if s.is_cuda() {
            s.require_finite_cuda()?;
        } else {
            // SAFETY: a CPU f32 tensor (checked above), alive while `s` is.
            forge_core::dtype::check_finite("scale_inv", unsafe { s.slice::<f32>() })
                .map_err(|e| core_err(w.obj.py(), e))?;
        }
    }
    Ok(Some(s))
}

/// The f32 values of a CPU FP8 weight with its block scales.
fn dequantized_cpu(py: Python<'_>, w: &Tensor<'_>, s: &Tensor<'_>) -> PyResult<Vec<f32>> {
    // SAFETY: CPU tensors whose dtypes (u8-sized fp8, f32) block_scales checked.
    let (bytes, scales) = unsafe { (w.slice::<u8>(), s.slice::<f32>()) };
    let (n, k) = (w.shape[0], w.shape[1]);
    detach_guarded(py, "dequantize_fp8_blocks", || {
        forge_core::dtype::dequantize_fp8_blocks(bytes, scales, n, k)
    })?
    .map_err(|e| core_err(py, e))
}

/// Range or MSE grid of a `(rows, cols)` weight: `(qmeta (rows, G, 4) uint8, maxq, pad)`.
#[pyfunction]
#[pyo3(signature = (weight, group_size, bits, symmetric, mode, quant_max_shrink, quant_n_grid, quant_norm, scale_inv=None))]
#[allow(clippy::too_many_arguments)]
pub fn build_quant_grid<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    group_size: i64,
    bits: i64,
    symmetric: bool,
    mode: &str,
    quant_max_shrink: f32,
    quant_n_grid: i64,
    quant_norm: f32,
    scale_inv: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, u32, usize)> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let w = weight_2d("weight", weight)?;
    let s = spec(py, bits, group_size, symmetric)?;
    let gm = match mode {
        "range" | "absmax" | "minmax" => GridMode::Range,
        "mse" => {
            let m = MseSpec {
                max_shrink: quant_max_shrink,
                n_grid: size_arg(py, "quant_n_grid", quant_n_grid, 1, 1024)?,
                norm: quant_norm,
            };
            m.validate().map_err(|e| core_err(py, e))?;
            GridMode::Mse(m)
        }
        other => {
            return Err(raise(
                py,
                "InvalidValueError",
                format!("mode: expected 'range' or 'mse', got {other:?}"),
            ));
        }
    };
    let (rows, cols) = (w.shape[0], w.shape[1]);
    let bs = block_scales(scale_inv, &w, true)?;
    if w.is_cuda() {
        if rows == 0 || cols == 0 {
            return Err(raise(
                py,
                "ShapeError",
                format!("weight: expected a non-empty 2-D tensor, got {:?}", w.shape),
            ));
        }
        let t = cuda_ops::build_quant_grid(&w, bs.as_ref(), &s, gm)?;
        return Ok((t, s.maxq(), s.pad(cols)));
    }
    let r = with_elements!(py, w, &bs, |x| detach_guarded(
        py,
        "build_quant_grid",
        || { grid::build_quant_grid(x, rows, cols, &s, gm) }
    )?);
    let (q, maxq, pad) = r.map_err(|e| core_err(py, e))?;
    let t = from_vec(py, &qmeta_bytes(&q), &[rows, s.groups(cols), 4], DType::U8)?;
    Ok((t, maxq, pad))
}

/// Round-to-nearest codes of `weight (N, K)` on its grid, returned as `(K, N)` uint8.
#[pyfunction]
pub fn quantize_rtn<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    bits: i64,
    group_size: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let w = weight_2d("weight", weight)?;
    w.require_cpu()?;
    let (n, k) = (w.shape[0], w.shape[1]);
    let s = spec(py, bits, group_size, false)?;
    let q = Tensor::extract("qmeta", qmeta)?;
    check_qmeta(
        &q,
        n,
        s.groups(k),
        "(N, ceil(K/group_size), 4) for weight (N, K)",
    )?;
    let qm = qmeta_vec(&q);
    let r = with_elements!(w, |x| detach_guarded(py, "quantize_rtn", || {
        grid::quantize_rtn(x, n, k, &s, &qm)
    })?);
    let codes = r.map_err(|e| core_err(py, e))?;
    from_vec(py, &codes, &[k, n], DType::U8)
}

/// Encodes float scales, zero points and symmetric flags into qmeta bytes `(..., 4)`.
#[pyfunction]
pub fn encode_qmeta<'py>(
    py: Python<'py>,
    scale: &Bound<'py, PyAny>,
    zero: &Bound<'py, PyAny>,
    symmetric: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let s = Tensor::extract("scale", scale)?;
    let z = Tensor::extract("zero", zero)?;
    let f = Tensor::extract("symmetric", symmetric)?;
    for t in [&s, &z, &f] {
        t.require_cpu()?;
    }
    s.require_dtype(&[DType::F32])?;
    z.require_dtype(&[DType::U8])?;
    f.require_dtype(&[DType::Bool])?;
    z.require_shape(&s.shape, "(same as scale)")?;
    f.require_shape(&s.shape, "(same as scale)")?;
    // SAFETY: dtypes checked above.
    let (sv, zv, fv): (&[f32], &[u8], &[u8]) = unsafe { (s.slice(), z.slice(), f.slice()) };
    if let Some(i) = sv.iter().position(|v| !(v.is_finite() && *v > 0.0)) {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("scale: must be positive and finite; index {i} is {}", sv[i]),
        ));
    }
    let q: Vec<QMeta> = (0..sv.len())
        .map(|i| QMeta::from_scale(sv[i], zv[i], fv[i] != 0))
        .collect();
    let mut shape = s.shape.clone();
    shape.push(4);
    from_vec(py, &qmeta_bytes(&q), &shape, DType::U8)
}

/// Decodes qmeta bytes `(..., 4)` into `(scale f32, stored zero uint8, symmetric bool)`.
#[pyfunction]
pub fn decode_qmeta<'py>(
    py: Python<'py>,
    qmeta: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let q = Tensor::extract("qmeta", qmeta)?;
    q.require_cpu()?;
    q.require_dtype(&[DType::U8])?;
    if q.shape.last() != Some(&4) {
        return Err(raise(
            py,
            "ShapeError",
            format!(
                "qmeta: expected a last dimension of 4 bytes, got shape {:?}",
                q.shape
            ),
        ));
    }
    let qm = qmeta_vec(&q);
    let shape = &q.shape[..q.shape.len() - 1];
    let scales: Vec<f32> = qm.iter().map(|m| m.scale()).collect();
    let zeros: Vec<u8> = qm.iter().map(|m| m.zero()).collect();
    let flags: Vec<u8> = qm.iter().map(|m| m.symmetric() as u8).collect();
    Ok((
        from_vec(py, &scales, shape, DType::F32)?,
        from_vec(py, &zeros, shape, DType::U8)?,
        from_vec(py, &flags, shape, DType::Bool)?,
    ))
}

/// GPTQ solve on `weight_t (C, R)`; returns `(codes (C, R) uint8, dequantized (C, R) f32)`.
#[pyfunction]
#[pyo3(signature = (weight_t, hinv_chol, qmeta, bits, group_size, block_size, perm=None))]
#[allow(clippy::too_many_arguments)]
pub fn gptq_solve<'py>(
    py: Python<'py>,
    weight_t: &Bound<'py, PyAny>,
    hinv_chol: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    bits: i64,
    group_size: i64,
    block_size: i64,
    perm: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let w = weight_2d("weight_t", weight_t)?;
    let block_size = size_arg(py, "block_size", block_size, 1, 1 << 20)?;
    let (c, r) = (w.shape[0], w.shape[1]);
    let s = spec(py, bits, group_size, false)?;
    let u = Tensor::extract("hinv_chol", hinv_chol)?;
    u.require_cpu()?;
    u.require_dtype(&[DType::F32])?;
    u.require_shape(&[c, c], "(C, C) for weight (C, R)")?;
    let q = Tensor::extract("qmeta", qmeta)?;
    check_qmeta(
        &q,
        r,
        s.groups(c),
        "(R, ceil(C/group_size), 4): the grid of weight.T",
    )?;
    let perm_v: Option<Vec<usize>> = match perm {
        None => None,
        Some(p) if p.is_none() => None,
        Some(p) => {
            let t = Tensor::extract("perm", p)?;
            t.require_cpu()?;
            t.require_dtype(&[DType::I64])?;
            t.require_shape(&[c], "(C,)")?;
            // SAFETY: int64 checked.
            let v: &[i64] = unsafe { t.slice() };
            if let Some(i) = v.iter().position(|&x| x < 0 || x as usize >= c) {
                return Err(raise(
                    py,
                    "InvalidValueError",
                    format!("perm: entries must be in 0..{c}; index {i} is {}", v[i]),
                ));
            }
            Some(v.iter().map(|&x| x as usize).collect())
        }
    };
    let qm = qmeta_vec(&q);
    // SAFETY: f32 checked.
    let uv: &[f32] = unsafe { u.slice() };
    let mut wv: Vec<f32> = with_elements!(w, |x| x
        .iter()
        .map(|v| forge_core::Element::to_f32(*v))
        .collect());
    let codes = detach_guarded(py, "gptq_solve", || {
        gptq::solve(&mut wv, c, r, uv, &qm, &s, block_size, perm_v.as_deref())
    })?
    .map_err(|e| core_err(py, e))?;
    Ok((
        from_vec(py, &codes, &[c, r], DType::U8)?,
        from_vec(py, &wv, &[c, r], DType::F32)?,
    ))
}

fn codes_tensor<'py>(codes: &Bound<'py, PyAny>) -> PyResult<Tensor<'py>> {
    let t = Tensor::extract("codes", codes)?;
    if !t.is_cuda() {
        t.require_cpu()?;
    }
    t.require_dtype(&[DType::U8])?;
    t.require_ndim(2, "(K, N)")?;
    Ok(t)
}

fn pack_spec<'py>(
    py: Python<'py>,
    qmeta: &Bound<'py, PyAny>,
    k: usize,
    n: usize,
    group_size: usize,
) -> PyResult<(GridSpec, Vec<QMeta>)> {
    let s = GridSpec {
        bits: 4,
        group_size,
        symmetric: false,
    };
    pack::check_pack_shape(k, n, &s).map_err(|e| core_err(py, e))?;
    let q = Tensor::extract("qmeta", qmeta)?;
    check_qmeta(&q, n, k / group_size, "(N, K/group_size, 4)")?;
    Ok((s, qmeta_vec(&q)))
}

/// The 4-bit pack spec and the CUDA qmeta tensor `(N, K/G, 4)` of a CUDA call.
fn pack_spec_cuda<'py>(
    py: Python<'py>,
    qmeta: &Bound<'py, PyAny>,
    like: &Tensor<'py>,
    k: usize,
    n: usize,
    group_size: usize,
) -> PyResult<(GridSpec, Tensor<'py>)> {
    let s = GridSpec {
        bits: 4,
        group_size,
        symmetric: false,
    };
    pack::check_pack_shape(k, n, &s).map_err(|e| core_err(py, e))?;
    let q = Tensor::extract("qmeta", qmeta)?;
    q.require_same_device(like)?;
    q.require_dtype(&[DType::U8])?;
    q.require_shape(&[n, k / group_size, 4], "(N, K/group_size, 4)")?;
    Ok((s, q))
}

fn awq_out<'py>(
    py: Python<'py>,
    a: pack::AwqTensors,
    k: usize,
    n: usize,
    g: usize,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    Ok((
        from_vec(py, &a.qweight, &[k, n / 8], DType::I32)?,
        from_vec(py, &a.qzeros, &[k / g, n / 8], DType::I32)?,
        from_vec(py, &a.scales, &[k / g, n], DType::F16)?,
    ))
}

type Three<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>);
type Four<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
);

/// Packs codes `(K, N)` with the grid `(N, K/G, 4)` into vLLM AWQ `(qweight, qzeros, scales)`.
#[pyfunction]
pub fn pack_awq<'py>(
    py: Python<'py>,
    codes: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<Three<'py>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let c = codes_tensor(codes)?;
    let (k, n) = (c.shape[0], c.shape[1]);
    if c.is_cuda() {
        let (s, q) = pack_spec_cuda(py, qmeta, &c, k, n, group_size)?;
        return cuda_ops::pack_awq(&c, &q, &s);
    }
    let (s, qm) = pack_spec(py, qmeta, k, n, group_size)?;
    // SAFETY: uint8 checked.
    let cv: &[u8] = unsafe { c.slice() };
    let a = detach_guarded(py, "pack_awq", || pack::pack_awq(cv, &qm, k, n, &s))?
        .map_err(|e| core_err(py, e))?;
    awq_out(py, a, k, n, group_size)
}

/// Fused round-to-nearest quantize + AWQ pack of `weight (N, K)` on its grid.
/// `check_finite=False` skips the NaN/Inf pass over a CUDA weight (for callers that built
/// the grid from the same weight, which checks it); CPU weights are always checked.
#[pyfunction]
#[pyo3(signature = (weight, qmeta, group_size, check_finite=true, scale_inv=None))]
pub fn quantize_pack_awq<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    group_size: i64,
    check_finite: bool,
    scale_inv: Option<&Bound<'py, PyAny>>,
) -> PyResult<Three<'py>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let w = weight_2d("weight", weight)?;
    let (n, k) = (w.shape[0], w.shape[1]);
    let bs = block_scales(scale_inv, &w, check_finite)?;
    if w.is_cuda() {
        let (s, q) = pack_spec_cuda(py, qmeta, &w, k, n, group_size)?;
        if check_finite {
            w.require_finite_cuda()?;
        }
        return cuda_ops::quantize_pack_awq(&w, &q, bs.as_ref(), &s);
    }
    let (s, qm) = pack_spec(py, qmeta, k, n, group_size)?;
    let r = with_elements!(py, w, &bs, |x| detach_guarded(
        py,
        "quantize_pack_awq",
        || { pack::quantize_pack_awq(x, &qm, n, k, &s) }
    )?);
    let a = r.map_err(|e| core_err(py, e))?;
    awq_out(py, a, k, n, group_size)
}

struct Packed<'py> {
    k: usize,
    n: usize,
    qweight: &'static [i32],
    qzeros: &'static [i32],
    _keep: (Tensor<'py>, Tensor<'py>),
}

fn packed<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    group_size: usize,
    gptq_layout: bool,
) -> PyResult<Packed<'py>> {
    let qw = Tensor::extract("qweight", qweight)?;
    let qz = Tensor::extract("qzeros", qzeros)?;
    for t in [&qw, &qz] {
        t.require_cpu()?;
        t.require_dtype(&[DType::I32])?;
        t.require_ndim(2, "")?;
    }
    let (k, n) = if gptq_layout {
        (qw.shape[0] * 8, qw.shape[1])
    } else {
        (qw.shape[0], qw.shape[1] * 8)
    };
    if group_size == 0 || k % group_size != 0 {
        return Err(raise(
            py,
            "ShapeError",
            format!("group_size: must divide in_features {k}, got {group_size}"),
        ));
    }
    qz.require_shape(&[k / group_size, n / 8], "(K/group_size, N/8)")?;
    // SAFETY: int32 checked.
    let (a, b) = unsafe { (qw.slice(), qz.slice()) };
    Ok(Packed {
        k,
        n,
        qweight: a,
        qzeros: b,
        _keep: (qw, qz),
    })
}

fn scales_slice<'py>(
    scales: &Bound<'py, PyAny>,
    k: usize,
    n: usize,
    g: usize,
) -> PyResult<(Tensor<'py>, &'static [f16])> {
    let s = Tensor::extract("scales", scales)?;
    s.require_cpu()?;
    s.require_dtype(&[DType::F16])?;
    s.require_shape(&[k / g, n], "(K/group_size, N)")?;
    // SAFETY: f16 checked.
    let v = unsafe { s.slice() };
    Ok((s, v))
}

/// Shared body of the two unpackers.
fn unpack_impl<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    group_size: i64,
    gptq_layout: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let p = packed(py, qweight, qzeros, group_size, gptq_layout)?;
    let (k, n) = (p.k, p.n);
    let (c, z) = detach_guarded(py, "unpack", || {
        if gptq_layout {
            pack::unpack_gptq(p.qweight, p.qzeros, k, n, group_size)
        } else {
            pack::unpack_awq(p.qweight, p.qzeros, k, n, group_size)
        }
    })?
    .map_err(|e| core_err(py, e))?;
    Ok((
        from_vec(py, &c, &[k, n], DType::U8)?,
        from_vec(py, &z, &[k / group_size, n], DType::U8)?,
    ))
}

/// Unpacks AWQ `(qweight, qzeros)` into `(codes (K, N), zeros (K/G, N))` uint8.
#[pyfunction]
pub fn unpack_awq<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    unpack_impl(py, qweight, qzeros, group_size, false)
}

/// Repacks an AWQ `qweight (K, N/8)` int32 (CPU) into the tile layout of the CUDA tiled
/// GEMV: int32 `(N/16, K/64, 32, 4)` (see `forge_core::pack::tile_awq`).
#[pyfunction]
pub fn tile_awq<'py>(py: Python<'py>, qweight: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let qw = Tensor::extract("qweight", qweight)?;
    qw.require_cpu()?;
    qw.require_dtype(&[DType::I32])?;
    qw.require_ndim(2, "")?;
    let (k, n) = (qw.shape[0], qw.shape[1] * 8);
    // SAFETY: int32 checked.
    let words = unsafe { qw.slice::<i32>() };
    let out = detach_guarded(py, "tile_awq", || pack::tile_awq(words, k, n))?
        .map_err(|e| core_err(py, e))?;
    from_vec(py, &out, &[n / 16, k / 64, 32, 4], DType::I32)
}

/// Dequantizes an AWQ layer to `W (N, K)` float32.
#[pyfunction]
pub fn dequantize_awq<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let p = packed(py, qweight, qzeros, group_size, false)?;
    let (k, n) = (p.k, p.n);
    let (_s, sv) = scales_slice(scales, k, n, group_size)?;
    let w = detach_guarded(py, "dequantize_awq", || {
        matmul::dequantize_awq(p.qweight, p.qzeros, sv, k, n, group_size)
    })?
    .map_err(|e| core_err(py, e))?;
    from_vec(py, &w, &[n, k], DType::F32)
}

/// `y (M, N) = x (M, K) · dequant(W)ᵀ` for an AWQ layer (float32 reference on the CPU).
#[pyfunction]
pub fn awq_matmul<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let xt = Tensor::extract("x", x)?;
    if xt.is_cuda() {
        xt.require_ndim(2, "(M, K)")?;
        let qw = Tensor::extract("qweight", qweight)?;
        let qz = Tensor::extract("qzeros", qzeros)?;
        let sc = Tensor::extract("scales", scales)?;
        qw.require_dtype(&[DType::I32])?;
        qz.require_dtype(&[DType::I32])?;
        sc.require_dtype(&[DType::F16])?;
        qw.require_ndim(2, "(K, N/8)")?;
        let (k, n) = (qw.shape[0], qw.shape[1] * 8);
        if k % group_size != 0 {
            return Err(raise(
                py,
                "ShapeError",
                format!("group_size: must divide in_features {k}, got {group_size}"),
            ));
        }
        qz.require_shape(&[k / group_size, n / 8], "(K/group_size, N/8)")?;
        sc.require_shape(&[k / group_size, n], "(K/group_size, N)")?;
        if xt.shape[1] != k {
            return Err(raise(
                py,
                "ShapeError",
                format!(
                    "x: expected (M, {k}) to match qweight's in_features, got {:?}",
                    xt.shape
                ),
            ));
        }
        return cuda_ops::awq_matmul(&xt, &qw, &qz, &sc, k, n, group_size);
    }
    let p = packed(py, qweight, qzeros, group_size, false)?;
    let (k, n) = (p.k, p.n);
    let (_s, sv) = scales_slice(scales, k, n, group_size)?;
    xt.require_cpu()?;
    xt.require_dtype(&[DType::F32])?;
    xt.require_ndim(2, "(M, K)")?;
    if xt.shape[1] != k {
        return Err(raise(
            py,
            "ShapeError",
            format!(
                "x: expected (M, {k}) to match qweight's in_features, got {:?}",
                xt.shape
            ),
        ));
    }
    let m = xt.shape[0];
    // SAFETY: f32 checked.
    let xv: &[f32] = unsafe { xt.slice() };
    let y = detach_guarded(py, "awq_matmul", || {
        matmul::w4a16_awq(xv, m, p.qweight, p.qzeros, sv, k, n, group_size)
    })?
    .map_err(|e| core_err(py, e))?;
    from_vec(py, &y, &[m, n], DType::F32)
}

/// Packs codes `(K, N)` with the grid into GPTQ v1 `(qweight, qzeros, scales, g_idx)`.
#[pyfunction]
pub fn pack_gptq<'py>(
    py: Python<'py>,
    codes: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<Four<'py>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let c = codes_tensor(codes)?;
    c.require_cpu()?;
    let (k, n) = (c.shape[0], c.shape[1]);
    let (s, qm) = pack_spec(py, qmeta, k, n, group_size)?;
    // SAFETY: uint8 checked.
    let cv: &[u8] = unsafe { c.slice() };
    let g = detach_guarded(py, "pack_gptq", || pack::pack_gptq(cv, &qm, k, n, &s))?
        .map_err(|e| core_err(py, e))?;
    Ok((
        from_vec(py, &g.qweight, &[k / 8, n], DType::I32)?,
        from_vec(py, &g.qzeros, &[k / group_size, n / 8], DType::I32)?,
        from_vec(py, &g.scales, &[k / group_size, n], DType::F16)?,
        from_vec(py, &g.g_idx, &[k], DType::I32)?,
    ))
}

/// Unpacks GPTQ v1 `(qweight, qzeros)` into `(codes (K, N), zeros (K/G, N))` uint8.
#[pyfunction]
pub fn unpack_gptq<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    unpack_impl(py, qweight, qzeros, group_size, true)
}

/// Dequantizes a GPTQ v1 layer to `W (N, K)` float32.
#[pyfunction]
pub fn dequantize_gptq<'py>(
    py: Python<'py>,
    qweight: &Bound<'py, PyAny>,
    qzeros: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    g_idx: &Bound<'py, PyAny>,
    group_size: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let p = packed(py, qweight, qzeros, group_size, true)?;
    let (k, n) = (p.k, p.n);
    let (_s, sv) = scales_slice(scales, k, n, group_size)?;
    let gi = Tensor::extract("g_idx", g_idx)?;
    gi.require_cpu()?;
    gi.require_dtype(&[DType::I32])?;
    gi.require_shape(&[k], "(K,)")?;
    // SAFETY: int32 checked.
    let gv: &[i32] = unsafe { gi.slice() };
    let w = detach_guarded(py, "dequantize_gptq", || {
        matmul::dequantize_gptq(p.qweight, p.qzeros, sv, gv, k, n, group_size)
    })?
    .map_err(|e| core_err(py, e))?;
    from_vec(py, &w, &[n, k], DType::F32)
}

/// GPTQ on a batch of matrices of one shape (e.g. all experts of a layer):
/// `weight_t (E, C, R)`, `hinv_chol (E, C, C)`, `qmeta (E, R, ceil(C/G), 4)`,
/// `perm (E, C)` int64 or None. Returns `(codes (E, C, R) uint8, dequantized (E, C, R) f32)`.
/// CUDA tensors run the batched CUDA solver; CPU tensors the core solver per matrix.
#[pyfunction]
#[pyo3(signature = (weight_t, hinv_chol, qmeta, bits, group_size, block_size, perm=None))]
#[allow(clippy::too_many_arguments)]
pub fn gptq_solve_batched<'py>(
    py: Python<'py>,
    weight_t: &Bound<'py, PyAny>,
    hinv_chol: &Bound<'py, PyAny>,
    qmeta: &Bound<'py, PyAny>,
    bits: i64,
    group_size: i64,
    block_size: i64,
    perm: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let group_size = size_arg(py, "group_size", group_size, 1, 1 << 20)?;
    let block_size = size_arg(py, "block_size", block_size, 1, 1 << 20)?;
    let s = spec(py, bits, group_size, false)?;
    let torch = py.import("torch")?;
    let w0 = Tensor::extract("weight_t", weight_t)?;
    w0.require_dtype(FLOATS)?;
    w0.require_ndim(3, "(E, C, R)")?;
    let (e, c, r) = (w0.shape[0], w0.shape[1], w0.shape[2]);
    if e == 0 || c == 0 || r == 0 {
        return Err(raise(
            py,
            "ShapeError",
            format!(
                "weight_t: expected a non-empty (E, C, R) tensor, got {:?}",
                w0.shape
            ),
        ));
    }
    let u = Tensor::extract("hinv_chol", hinv_chol)?;
    u.require_same_device(&w0)?;
    u.require_dtype(&[DType::F32])?;
    u.require_shape(&[e, c, c], "(E, C, C) for weight_t (E, C, R)")?;
    let q = Tensor::extract("qmeta", qmeta)?;
    q.require_same_device(&w0)?;
    q.require_dtype(&[DType::U8])?;
    q.require_shape(&[e, r, s.groups(c), 4], "(E, R, ceil(C/group_size), 4)")?;
    let perm_t = match perm {
        Some(p) if !p.is_none() => {
            let t = Tensor::extract("perm", p)?;
            t.require_same_device(&w0)?;
            t.require_dtype(&[DType::I64])?;
            t.require_shape(&[e, c], "(E, C)")?;
            let sorted = t.obj.call_method1("sort", (-1,))?.getattr("values")?;
            let want = torch
                .call_method1("arange", (c,))?
                .call_method1("to", (t.obj.getattr("device")?,))?;
            let ok: bool = sorted
                .call_method1("eq", (want,))?
                .call_method0("all")?
                .call_method0("item")?
                .extract()?;
            if !ok {
                return Err(raise(
                    py,
                    "InvalidValueError",
                    format!("perm: every row must be a permutation of 0..{c}"),
                ));
            }
            Some(t)
        }
        _ => None,
    };
    if w0.is_cuda() {
        w0.require_finite_cuda()?;
        u.require_finite_cuda()?;
        let w32 = w0
            .obj
            .call_method1("to", (torch.getattr("float32")?,))?
            .call_method0("clone")?;
        let w = Tensor::extract("weight_t", &w32)?;
        let p32 = match &perm_t {
            Some(t) => Some(t.obj.call_method1("to", (torch.getattr("int32")?,))?),
            None => None,
        };
        let pt = match &p32 {
            Some(o) => Some(Tensor::extract("perm", o)?),
            None => None,
        };
        let codes = cuda_ops::gptq_solve(&w, &u, &q, pt.as_ref(), e, c, r, &s, block_size)?;
        return Ok((codes, w32));
    }
    w0.require_cpu()?;
    let (codes_t, cp) = crate::tensor::empty(py, &[e, c, r], DType::U8)?;
    let (deq_t, dp) = crate::tensor::empty(py, &[e, c, r], DType::F32)?;
    // SAFETY: dtypes and shapes checked; outputs freshly allocated with these sizes.
    let uv: &[f32] = unsafe { u.slice() };
    let qm = qmeta_vec(&q);
    let perms: Option<Vec<usize>> = perm_t.as_ref().map(|t| {
        unsafe { t.slice::<i64>() }
            .iter()
            .map(|&x| x as usize)
            .collect()
    });
    let ng = s.groups(c);
    for ei in 0..e {
        let mut wv: Vec<f32> = with_elements!(w0, |x| x[ei * c * r..(ei + 1) * c * r]
            .iter()
            .map(|v| forge_core::Element::to_f32(*v))
            .collect());
        let uu = &uv[ei * c * c..(ei + 1) * c * c];
        let qq = &qm[ei * r * ng..(ei + 1) * r * ng];
        let pp = perms.as_ref().map(|p| &p[ei * c..(ei + 1) * c]);
        let codes = detach_guarded(py, "gptq_solve_batched", || {
            gptq::solve(&mut wv, c, r, uu, qq, &s, block_size, pp)
        })?
        .map_err(|err| core_err(py, err))?;
        // SAFETY: ei-th slab of freshly allocated outputs.
        unsafe {
            std::ptr::copy_nonoverlapping(codes.as_ptr(), (cp as *mut u8).add(ei * c * r), c * r);
            std::ptr::copy_nonoverlapping(wv.as_ptr(), (dp as *mut f32).add(ei * c * r), c * r);
        }
    }
    Ok((codes_t, deq_t))
}

/// `hessian (D, D) += alpha · xᵀ x` in float32, for `x (T, D)` (f32/f16/bf16). CUDA tensors
/// run the CUDA kernel; CPU tensors a faer GEMM. `check_finite=false` skips the NaN/Inf pass
/// over a CUDA `x` (a read and a host sync) for callers that detect them otherwise.
#[pyfunction]
#[pyo3(signature = (hessian, x, alpha, check_finite=true))]
pub fn hessian_update<'py>(
    py: Python<'py>,
    hessian: &Bound<'py, PyAny>,
    x: &Bound<'py, PyAny>,
    alpha: f32,
    check_finite: bool,
) -> PyResult<()> {
    let h = Tensor::extract("hessian", hessian)?;
    let xt = Tensor::extract("x", x)?;
    xt.require_same_device(&h)?;
    h.require_dtype(&[DType::F32])?;
    xt.require_dtype(&[DType::F32, DType::F16, DType::BF16])?;
    xt.require_ndim(2, "(T, D)")?;
    let d = xt.shape[1];
    h.require_shape(&[d, d], "(D, D) for x (T, D)")?;
    if !hessian.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(raise(
            py,
            "ShapeError",
            "hessian: must be contiguous (it is updated in place)",
        ));
    }
    require_finite_alpha(py, alpha)?;
    if xt.shape[0] == 0 {
        return Ok(());
    }
    if h.is_cuda() {
        if check_finite {
            xt.require_finite_cuda()?;
        }
        return cuda_ops::hessian_update(&h, &xt, alpha);
    }
    h.require_cpu()?;
    let t = xt.shape[0];
    let xv: Vec<f32> = with_elements!(xt, |x| x
        .iter()
        .map(|v| forge_core::Element::to_f32(*v))
        .collect());
    forge_core::dtype::check_finite("x", &xv).map_err(|e| core_err(py, e))?;
    let hp = h.ptr;
    detach_guarded(py, "hessian_update", || {
        // SAFETY: hessian is a contiguous CPU f32 (D, D) tensor, exclusively updated here.
        let hv = unsafe { std::slice::from_raw_parts_mut(hp as *mut f32, d * d) };
        forge_core::matmul::syrk_update(hv, &xv, t, d, alpha)
    })?
    .map_err(|e| core_err(py, e))
}

/// The Hessian updates' scale `alpha` must be finite (it multiplies every product into H).
fn require_finite_alpha(py: Python<'_>, alpha: f32) -> PyResult<()> {
    if alpha.is_finite() {
        return Ok(());
    }
    Err(raise(
        py,
        "InvalidValueError",
        format!("alpha: must be finite, got {alpha}"),
    ))
}

/// The kernel `hessian_update(hessian, x)` runs: `"wgmma"`, `"mma_sync"` or `"simt"` on CUDA
/// (`forge_cuda::ops::hessian_kernel`), `"cpu"` otherwise; for callers choosing between it and
/// another library's product.
#[pyfunction]
pub fn hessian_kernel<'py>(
    hessian: &Bound<'py, PyAny>,
    x: &Bound<'py, PyAny>,
) -> PyResult<&'static str> {
    let h = Tensor::extract("hessian", hessian)?;
    let xt = Tensor::extract("x", x)?;
    xt.require_same_device(&h)?;
    xt.require_ndim(2, "(T, D)")?;
    if !h.is_cuda() {
        return Ok("cpu");
    }
    cuda_ops::hessian_kernel(&h, &xt)
}

/// Per-expert Hessians of routed experts: for expert `e`, the rows
/// `x[idx[offsets[e]:offsets[e+1]]]` update `hessian[e] += alpha · X_eᵀ X_e`.
/// `hessian (E, D, D)` f32, `x (T, D)`, `idx` int32 token indices, `offsets (E + 1,)` int32.
/// Offsets and the indices' range are always checked (two host syncs); `check_finite=false`
/// skips the NaN/Inf pass over a CUDA `x`, as for `hessian_update`. `overwrite=true` writes
/// `hessian[e] = alpha · X_eᵀ X_e` instead (an expert without rows zeroed; H not read).
#[pyfunction]
#[pyo3(signature = (hessian, x, idx, offsets, alpha, check_finite=true, overwrite=false))]
#[allow(clippy::too_many_arguments)]
pub fn hessian_update_segmented<'py>(
    py: Python<'py>,
    hessian: &Bound<'py, PyAny>,
    x: &Bound<'py, PyAny>,
    idx: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    alpha: f32,
    check_finite: bool,
    overwrite: bool,
) -> PyResult<()> {
    let h = Tensor::extract("hessian", hessian)?;
    let xt = Tensor::extract("x", x)?;
    let it = Tensor::extract("idx", idx)?;
    let ot = Tensor::extract("offsets", offsets)?;
    for t in [&xt, &it, &ot] {
        t.require_same_device(&h)?;
    }
    h.require_dtype(&[DType::F32])?;
    xt.require_dtype(&[DType::F32, DType::F16, DType::BF16])?;
    it.require_dtype(&[DType::I32])?;
    ot.require_dtype(&[DType::I32])?;
    xt.require_ndim(2, "(T, D)")?;
    it.require_ndim(1, "(S,)")?;
    h.require_ndim(3, "(E, D, D)")?;
    let (tt, d) = (xt.shape[0], xt.shape[1]);
    let e = h.shape[0];
    h.require_shape(&[e, d, d], "(E, D, D) for x (T, D)")?;
    ot.require_shape(&[e + 1], "(E + 1,)")?;
    if !hessian.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(raise(
            py,
            "ShapeError",
            "hessian: must be contiguous (it is updated in place)",
        ));
    }
    require_finite_alpha(py, alpha)?;
    // Offsets and indices are small: validate them on the host.
    let offs: Vec<i64> = ot.obj.call_method0("tolist")?.extract()?;
    let s_len = it.shape[0] as i64;
    if offs[0] != 0 || offs.windows(2).any(|w| w[1] < w[0]) || offs[e] != s_len {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("offsets: must start at 0, not decrease and end at len(idx) = {s_len}"),
        ));
    }
    if s_len == 0 {
        // No routed rows: nothing to add (an empty idx has no device pointer to launch with),
        // or only zeros to write.
        if overwrite {
            hessian.call_method0("zero_")?;
        }
        return Ok(());
    }
    // One pass and one sync for both ends.
    let torch = py.import("torch")?;
    let ends = torch.call_method1("aminmax", (&it.obj,))?;
    let v: Vec<i64> = torch
        .call_method1("stack", (ends,))?
        .call_method0("tolist")?
        .extract()?;
    let (lo, hi) = (v[0], v[1]);
    if lo < 0 || hi >= tt as i64 {
        return Err(raise(
            py,
            "InvalidValueError",
            format!("idx: token indices must be in 0..{tt}, found {lo}..={hi}"),
        ));
    }
    if h.is_cuda() {
        if check_finite {
            xt.require_finite_cuda()?;
        }
        return cuda_ops::hessian_update_segmented(&h, &xt, &it, &ot, e, alpha, overwrite);
    }
    h.require_cpu()?;
    let xv: Vec<f32> = with_elements!(xt, |x| x
        .iter()
        .map(|v| forge_core::Element::to_f32(*v))
        .collect());
    forge_core::dtype::check_finite("x", &xv).map_err(|err| core_err(py, err))?;
    // SAFETY: int32 checked.
    let iv: &[i32] = unsafe { it.slice() };
    let hp = h.ptr;
    detach_guarded(py, "hessian_update_segmented", || {
        for ei in 0..e {
            let rows = &iv[offs[ei] as usize..offs[ei + 1] as usize];
            // SAFETY: slab ei of a contiguous CPU f32 (E, D, D) tensor.
            let hv =
                unsafe { std::slice::from_raw_parts_mut((hp as *mut f32).add(ei * d * d), d * d) };
            if overwrite {
                hv.fill(0.0);
            }
            if rows.is_empty() {
                continue;
            }
            let mut xe = Vec::with_capacity(rows.len() * d);
            for &r in rows {
                xe.extend_from_slice(&xv[r as usize * d..(r as usize + 1) * d]);
            }
            forge_core::matmul::syrk_update(hv, &xe, rows.len(), d, alpha)?;
        }
        Ok(())
    })?
    .map_err(|err| core_err(py, err))
}
