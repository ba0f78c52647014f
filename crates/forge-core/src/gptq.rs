//! GPTQ (Frantar et al., Algorithm 1) on the transposed `(C, R)` convention, driven by
//! qmeta4. The trailing GEMM is faer. Hessians are prepared by `forge.prepare_hessian_batched`
//! (one implementation for both devices); `reference` is the Rust tests' preparation.

use crate::dtype::check_finite;
use crate::error::{check_len, Error, Result};
use crate::grid::GridSpec;
use crate::qmeta::{GroupParams, QMeta};
use faer::{Accum, MatMut, MatRef, Par};
use multiversion::multiversion;
use rayon::prelude::*;

#[cfg(any(test, feature = "reference"))]
#[path = "gptq_reference.rs"]
pub mod reference;

/// Column tile width of the in-block loop (columns of `(C, R)` are independent there).
const R_TILE: usize = 256;

/// GPTQ solve. `weight_t` is `W.T` (row-major `C × R`) and is overwritten with the
/// dequantized result `Ŵ.T`; `hinv_chol` is `U` with `H⁻¹ = Uᵀ U` (in processing order);
/// `qmeta` is the grid of `W` (`R × ceil(C/G)`); `perm` the processing order from
/// the same preparation. Returns the codes as `C × R` bytes in the original input order.
#[allow(clippy::too_many_arguments)]
pub fn solve(
    weight_t: &mut [f32],
    c: usize,
    r: usize,
    hinv_chol: &[f32],
    qmeta: &[QMeta],
    spec: &GridSpec,
    block_size: usize,
    perm: Option<&[usize]>,
) -> Result<Vec<u8>> {
    spec.validate()?;
    if c == 0 || r == 0 {
        return Err(Error::shape(
            "weight",
            "a non-empty 2-D tensor",
            format!("{c}x{r}"),
        ));
    }
    check_len("weight_t", weight_t.len(), c, r)?;
    check_len("hinv_chol", hinv_chol.len(), c, c)?;
    let ng = spec.groups(c);
    check_len("qmeta", qmeta.len(), r, ng)?;
    if block_size == 0 {
        return Err(Error::param("block_size", "must be positive", block_size));
    }
    check_finite("weight_t", weight_t)?;
    check_finite("hinv_chol", hinv_chol)?;
    if let Some(i) = (0..c).find(|&i| hinv_chol[i * c + i] <= 0.0) {
        return Err(Error::param(
            "hinv_chol",
            format!("diagonal must be positive (an upper Cholesky factor); entry {i} is not"),
            hinv_chol[i * c + i],
        ));
    }
    if let Some(p) = perm {
        let mut seen = vec![false; c];
        if p.len() != c
            || p.iter()
                .any(|&i| i >= c || std::mem::replace(&mut seen[i], true))
        {
            return Err(Error::shape(
                "perm",
                format!("a permutation of 0..{c}"),
                "something else",
            ));
        }
    }
    let src = |j: usize| perm.map_or(j, |p| p[j]);

    // Working copy in processing order.
    let mut w = vec![0f32; c * r];
    w.par_chunks_mut(r).enumerate().for_each(|(j, row)| {
        let s = src(j);
        row.copy_from_slice(&weight_t[s * r..(s + 1) * r]);
    });
    let mut codes = vec![0u8; c * r];
    let bits = spec.bits;

    let mut i1 = 0;
    while i1 < c {
        let i2 = (i1 + block_size).min(c);
        let bsz = i2 - i1;
        let mut err = vec![0f32; bsz * r];
        // In-block loop, parallel over column tiles.
        {
            let w_block = &mut w[i1 * r..i2 * r];
            let codes_block = &mut codes[i1 * r..i2 * r];
            let tiles: Vec<usize> = (0..r).step_by(R_TILE).collect();
            // Split the block rows by column tiles through raw indexing per tile.
            let w_ptr = SyncPtr(w_block.as_mut_ptr());
            let e_ptr = SyncPtr(err.as_mut_ptr());
            let q_ptr = SyncPtr(codes_block.as_mut_ptr());
            tiles.par_iter().for_each(|&r0| {
                let r1 = (r0 + R_TILE).min(r);
                let mut params: Vec<GroupParams> = Vec::with_capacity(r1 - r0);
                let mut cached_g = usize::MAX;
                for jj in 0..bsz {
                    let j = i1 + jj;
                    let g = src(j) / spec.group_size;
                    if g != cached_g {
                        params.clear();
                        params.extend((r0..r1).map(|rr| qmeta[rr * ng + g].params(bits)));
                        cached_g = g;
                    }
                    let d = hinv_chol[j * c + j];
                    // SAFETY: each task touches only columns [r0, r1) of the block rows.
                    unsafe {
                        let wrow =
                            std::slice::from_raw_parts_mut(w_ptr.get().add(jj * r + r0), r1 - r0);
                        let erow =
                            std::slice::from_raw_parts_mut(e_ptr.get().add(jj * r + r0), r1 - r0);
                        let qrow =
                            std::slice::from_raw_parts_mut(q_ptr.get().add(jj * r + r0), r1 - r0);
                        quantize_row(wrow, erow, qrow, &params, d);
                        for kk in (jj + 1)..bsz {
                            let coef = hinv_chol[j * c + i1 + kk];
                            if coef == 0.0 {
                                continue;
                            }
                            let krow = std::slice::from_raw_parts_mut(
                                w_ptr.get().add(kk * r + r0),
                                r1 - r0,
                            );
                            axpy_neg(krow, coef, erow);
                        }
                    }
                }
            });
        }
        // Trailing update W[i2:, :] -= U[i1:i2, i2:]ᵀ · Err.
        if i2 < c {
            let rest = c - i2;
            let dst = MatMut::from_row_major_slice_mut(&mut w[i2 * r..], rest, r);
            let lhs =
                MatRef::from_row_major_slice_with_stride(&hinv_chol[i1 * c + i2..], bsz, rest, c)
                    .transpose();
            let rhs = MatRef::from_row_major_slice(&err, bsz, r);
            faer::linalg::matmul::matmul(dst, Accum::Add, lhs, rhs, -1.0f32, Par::rayon(0));
        }
        i1 = i2;
    }

    // Back to the original order.
    let mut out_codes = vec![0u8; c * r];
    for j in 0..c {
        let s = src(j);
        weight_t[s * r..(s + 1) * r].copy_from_slice(&w[j * r..(j + 1) * r]);
        out_codes[s * r..(s + 1) * r].copy_from_slice(&codes[j * r..(j + 1) * r]);
    }
    Ok(out_codes)
}

/// Quantizes one row segment: codes, dequantized values and the scaled error `(w − ŵ)/d`.
#[multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
fn quantize_row(w: &mut [f32], err: &mut [f32], codes: &mut [u8], params: &[GroupParams], d: f32) {
    for (((x, e), q), p) in w
        .iter_mut()
        .zip(err.iter_mut())
        .zip(codes.iter_mut())
        .zip(params)
    {
        let c = p.code(*x);
        let xq = p.dequant(c);
        *q = c as u8;
        *e = (*x - xq) / d;
        *x = xq;
    }
}

/// `y -= a * x`.
#[multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
fn axpy_neg(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y -= a * *x;
    }
}

#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: used only to hand disjoint column ranges of one buffer to rayon tasks.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::reference::prepare_hessian;
    use super::*;
    use crate::grid::build_range;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn gptq_beats_rtn_on_correlated_inputs() {
        let (n, k, t) = (48usize, 128usize, 512usize);
        let mut s = 7u64;
        let basis: Vec<f32> = (0..4 * k).map(|_| lcg(&mut s)).collect();
        let mut x = vec![0f32; t * k];
        for row in 0..t {
            let coef: Vec<f32> = (0..4).map(|_| lcg(&mut s) * 3.0).collect();
            for col in 0..k {
                let mut v = 0.1 * lcg(&mut s);
                for b in 0..4 {
                    v += coef[b] * basis[b * k + col];
                }
                x[row * k + col] = v;
            }
        }
        let mut h = vec![0f32; k * k];
        for row in 0..t {
            for a in 0..k {
                for b in 0..k {
                    h[a * k + b] += 2.0 * x[row * k + a] * x[row * k + b] / t as f32;
                }
            }
        }
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
        let spec = GridSpec {
            bits: 4,
            group_size: 32,
            symmetric: false,
        };
        let qmeta = build_range(&w, n, k, &spec).unwrap();
        let err = |wq_t: &[f32]| {
            let mut e = 0f64;
            for row in 0..t {
                for o in 0..n {
                    let mut acc = 0f64;
                    for col in 0..k {
                        acc += (x[row * k + col] * (w[o * k + col] - wq_t[col * n + o])) as f64;
                    }
                    e += acc * acc;
                }
            }
            e
        };
        let mut rtn_t = vec![0f32; k * n];
        for o in 0..n {
            for col in 0..k {
                let p = qmeta[o * (k / 32) + col / 32].params(4);
                rtn_t[col * n + o] = p.dequant(p.code(w[o * k + col]));
            }
        }
        for act_order in [false, true] {
            let f = prepare_hessian(&h, k, 0.01, act_order).unwrap();
            let mut wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            let codes = solve(
                &mut wt,
                k,
                n,
                &f.hinv_chol,
                &qmeta,
                &spec,
                32,
                f.perm.as_deref(),
            )
            .unwrap();
            // codes and Ŵ agree
            for col in 0..k {
                for o in 0..n {
                    let p = qmeta[o * (k / 32) + col / 32].params(4);
                    assert_eq!(p.dequant(codes[col * n + o] as f32), wt[col * n + o]);
                }
            }
            let (eg, er) = (err(&wt), err(&rtn_t));
            assert!(eg < 0.5 * er, "act_order={act_order} gptq {eg} rtn {er}");
        }
    }
}
