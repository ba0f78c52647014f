//! Reference dequantisation and W4A16 matmul on the CPU.

use crate::error::{check_len, Error, Result};
use crate::pack::{unpack_awq, unpack_gptq};
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

fn dequant_from(
    codes: &[u8],
    zeros: &[u8],
    scales: &[f16],
    g_of: impl Fn(usize) -> usize + Sync,
    k: usize,
    n: usize,
) -> Vec<f32> {
    // W [N, K]
    let mut w = vec![0f32; n * k];
    w.par_chunks_mut(k).enumerate().for_each(|(o, row)| {
        for (kk, v) in row.iter_mut().enumerate() {
            let g = g_of(kk);
            let q = codes[kk * n + o] as f32;
            let z = zeros[g * n + o] as f32;
            *v = (q - z) * scales[g * n + o].to_f32();
        }
    });
    w
}

/// Dequantizes an AWQ layer to `W [N, K]` (the PyTorch `nn.Linear` layout), fp32.
pub fn dequantize_awq(
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f16],
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<Vec<f32>> {
    let (codes, zeros) = unpack_awq(qweight, qzeros, k, n, group_size)?;
    check_len("scales", scales.len(), k / group_size, n)?;
    Ok(dequant_from(
        &codes,
        &zeros,
        scales,
        |kk| kk / group_size,
        k,
        n,
    ))
}

/// Dequantizes a GPTQ v1 layer to `W [N, K]`, honouring `g_idx`.
#[allow(clippy::too_many_arguments)]
pub fn dequantize_gptq(
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f16],
    g_idx: &[i32],
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<Vec<f32>> {
    let (codes, zeros) = unpack_gptq(qweight, qzeros, k, n, group_size)?;
    let ng = k / group_size;
    check_len("scales", scales.len(), ng, n)?;
    if g_idx.len() != k {
        return Err(Error::shape("g_idx", format!("{k} entries"), g_idx.len()));
    }
    if let Some(i) = g_idx.iter().position(|&g| g < 0 || g as usize >= ng) {
        return Err(Error::param(
            "g_idx",
            format!("entries must be in 0..{ng}; index {i} is not"),
            g_idx[i],
        ));
    }
    Ok(dequant_from(
        &codes,
        &zeros,
        scales,
        |kk| g_idx[kk] as usize,
        k,
        n,
    ))
}

/// `y [M, N] = x [M, K] · dequant(W)ᵀ` for an AWQ layer, fp32 accumulate (reference path).
#[allow(clippy::too_many_arguments)]
pub fn w4a16_awq(
    x: &[f32],
    m: usize,
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f16],
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<Vec<f32>> {
    check_len("x", x.len(), m, k)?;
    let w = dequantize_awq(qweight, qzeros, scales, k, n, group_size)?;
    let mut y = vec![0f32; m * n];
    let dst = MatMut::from_row_major_slice_mut(&mut y, m, n);
    let lhs = MatRef::from_row_major_slice(x, m, k);
    let rhs = MatRef::from_row_major_slice(&w, n, k).transpose();
    faer::linalg::matmul::matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, Par::rayon(0));
    Ok(y)
}

/// `H (D × D) += alpha · Xᵀ X` for row-major `X (T × D)`, fp32 (the GPTQ Hessian update).
pub fn syrk_update(h: &mut [f32], x: &[f32], t: usize, d: usize, alpha: f32) -> Result<()> {
    check_len("hessian", h.len(), d, d)?;
    check_len("x", x.len(), t, d)?;
    let dst = MatMut::from_row_major_slice_mut(h, d, d);
    let xm = MatRef::from_row_major_slice(x, t, d);
    faer::linalg::matmul::matmul(dst, Accum::Add, xm.transpose(), xm, alpha, Par::rayon(0));
    Ok(())
}
