//! Quantization grids: range-based group metadata and the MSE / L^p shrink search
//! (spec gptq-core-qmeta4 §6.2, §6.3; exact arithmetic in `docs/numerics.md`).

use crate::dtype::{check_finite, Element};
use crate::error::{check_len, Error, Result};
use crate::pmath::pow_p;
use crate::qmeta::{decode_scale, encode_log2_q88, GroupParams, QMeta, FLAG_SYMMETRIC};
use multiversion::multiversion;
use rayon::prelude::*;

/// Added to every range-based scale (spec §6.2).
pub const EPS: f32 = 1e-9;

/// Smallest scale a grid stores: `2^-24`, the smallest positive fp16 (subnormal), exactly
/// representable in qmeta4 (log2 Q8.8 = −6144). Every qmeta whose log2 field is ≥ −6144
/// decodes to ≥ 2^-24 and so converts to a positive fp16 AWQ scale; [`EPS`] alone (1e-9)
/// would round to an fp16 scale of 0 for all-zero and tiny groups, which vLLM
/// and `verify` reject.
pub const SCALE_MIN: f32 = 1.0 / 16_777_216.0;

/// Lanes of the fixed summation order of the MSE search (one CUDA warp).
pub const LANES: usize = 32;

/// What grid to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridSpec {
    /// Bits per code, 2..=8.
    pub bits: u8,
    /// Elements per group: a multiple of 32 from 32 to 1024.
    pub group_size: usize,
    /// Symmetric (zero point fixed at (maxq + 1) / 2) or asymmetric.
    pub symmetric: bool,
}

impl GridSpec {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        if !(2..=8).contains(&self.bits) {
            return Err(Error::param("bits", "must be between 2 and 8", self.bits));
        }
        if self.group_size < 32 || self.group_size > 1024 || !self.group_size.is_multiple_of(32) {
            return Err(Error::param(
                "group_size",
                "must be a multiple of 32 between 32 and 1024 (e.g. 32, 64, 128, 256)",
                self.group_size,
            ));
        }
        Ok(())
    }
    /// Largest code.
    pub fn maxq(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
    /// Groups per row of length `cols`.
    pub fn groups(&self, cols: usize) -> usize {
        cols.div_ceil(self.group_size)
    }
    /// Zero padding of the last group.
    pub fn pad(&self, cols: usize) -> usize {
        self.groups(cols) * self.group_size - cols
    }
}

/// Parameters of the MSE / L^p shrink search.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MseSpec {
    /// Candidates span `[1 - max_shrink, 1 + max_shrink]` (spec default 0.2).
    pub max_shrink: f32,
    /// Number of candidates, 1..=1024 (default 100).
    pub n_grid: usize,
    /// Exponent p of the loss Σ|e|^p (default 2.4; 2 uses e·e exactly).
    pub norm: f32,
}

impl Default for MseSpec {
    fn default() -> Self {
        MseSpec {
            max_shrink: 0.2,
            n_grid: 100,
            norm: 2.4,
        }
    }
}

impl MseSpec {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        if !(self.max_shrink.is_finite() && (0.0..1.0).contains(&self.max_shrink)) {
            return Err(Error::param(
                "quant_max_shrink",
                "must be in [0, 1)",
                self.max_shrink,
            ));
        }
        if !(1..=1024).contains(&self.n_grid) {
            return Err(Error::param(
                "quant_n_grid",
                "must be between 1 and 1024",
                self.n_grid,
            ));
        }
        if !(self.norm.is_finite() && self.norm > 0.0) {
            return Err(Error::param(
                "quant_norm",
                "must be a positive finite number",
                self.norm,
            ));
        }
        Ok(())
    }
    /// The shrink factors `p_i = f32(1 - s + i * 2s / (n - 1))`.
    pub fn candidates(&self) -> Vec<f32> {
        if self.n_grid == 1 {
            return vec![1.0];
        }
        let s = self.max_shrink as f64;
        let step = 2.0 * s / (self.n_grid as f64 - 1.0);
        (0..self.n_grid)
            .map(|i| (1.0 - s + i as f64 * step) as f32)
            .collect()
    }
}

/// Copies group `g` of a row into `buf` (zero padded).
#[inline]
fn load_group<T: Element>(row: &[T], g: usize, group_size: usize, buf: &mut [f32]) {
    let start = g * group_size;
    let end = (start + group_size).min(row.len());
    let n = end - start;
    for (b, v) in buf[..n].iter_mut().zip(&row[start..end]) {
        *b = v.to_f32();
    }
    buf[n..].fill(0.0);
}

/// Range-based metadata of one group (padding included).
#[inline]
pub fn range_meta(group: &[f32], spec: &GridSpec) -> QMeta {
    // 8 lanes with compare-select (inputs are finite: checked before), so it vectorises;
    // min/max are exact, so the lane split does not change the result.
    let mut lo = [f32::INFINITY; 8];
    let mut hi = [f32::NEG_INFINITY; 8];
    for chunk in group.chunks_exact(8) {
        for l in 0..8 {
            let v = chunk[l];
            lo[l] = if v < lo[l] { v } else { lo[l] };
            hi[l] = if v > hi[l] { v } else { hi[l] };
        }
    }
    for &v in group.chunks_exact(8).remainder() {
        lo[0] = if v < lo[0] { v } else { lo[0] };
        hi[0] = if v > hi[0] { v } else { hi[0] };
    }
    // The grid always contains 0 (GPTQ `Quantizer.find_params`): a one-signed group
    // such as [0.4, 0.6] gets the range [0, 0.6] and zero point 0 instead of a clamped
    // zero point that shifts every value.
    let xmin = lo.iter().fold(0.0f32, |a, &b| if b < a { b } else { a });
    let xmax = hi.iter().fold(0.0f32, |a, &b| if b > a { b } else { a });
    let maxq = spec.maxq() as f32;
    if spec.symmetric {
        let amax = xmin.abs().max(xmax.abs());
        let s = ((2.0 * amax) / maxq + EPS).max(SCALE_MIN);
        QMeta::from_scale(s, (1u32 << (spec.bits - 1)) as u8, true)
    } else {
        let s = ((xmax - xmin) / maxq + EPS).max(SCALE_MIN);
        let z = (-xmin / s).round_ties_even().clamp(0.0, maxq);
        QMeta::from_scale(s, z as u8, false)
    }
}

fn check_inputs<T: Element>(x: &[T], rows: usize, cols: usize, spec: &GridSpec) -> Result<()> {
    spec.validate()?;
    if cols == 0 || rows == 0 {
        return Err(Error::shape(
            "weight",
            "a non-empty 2-D tensor",
            format!("{rows}x{cols}"),
        ));
    }
    check_len("weight", x.len(), rows, cols)?;
    check_finite("weight", x)
}

#[multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
fn range_row<T: Element>(row: &[T], meta_row: &mut [QMeta], spec: &GridSpec, buf: &mut [f32]) {
    for (g, m) in meta_row.iter_mut().enumerate() {
        load_group(row, g, spec.group_size, buf);
        *m = range_meta(buf, spec);
    }
}

#[multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
fn mse_row<T: Element>(
    row: &[T],
    meta_row: &mut [QMeta],
    spec: &GridSpec,
    cands: &[f32],
    norm: f32,
    buf: &mut [f32],
) {
    for (g, m) in meta_row.iter_mut().enumerate() {
        load_group(row, g, spec.group_size, buf);
        *m = mse_refine_group(buf, *m, spec.bits, cands, norm);
    }
}

/// Round-to-nearest codes of one row on its grid row (`meta_row`, one qmeta per group).
#[multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
pub(crate) fn rtn_row<T: Element>(row: &[T], meta_row: &[QMeta], spec: &GridSpec, out: &mut [u8]) {
    let cols = row.len();
    for (g, m) in meta_row.iter().enumerate() {
        let p = m.params(spec.bits);
        let end = ((g + 1) * spec.group_size).min(cols);
        for c in g * spec.group_size..end {
            out[c] = p.code(row[c].to_f32()) as u8;
        }
    }
}

/// Range-based grid of a row-major `[rows, cols]` tensor: `rows * groups(cols)` qmeta.
pub fn build_range<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    spec: &GridSpec,
) -> Result<Vec<QMeta>> {
    check_inputs(x, rows, cols, spec)?;
    let ng = spec.groups(cols);
    let mut out = vec![QMeta(0); rows * ng];
    out.par_chunks_mut(ng)
        .zip(x.par_chunks(cols))
        .for_each_init(
            || vec![0f32; spec.group_size],
            |buf, (meta_row, row)| range_row(row, meta_row, spec, buf),
        );
    Ok(out)
}

/// Loss of one candidate scale on one group, in the fixed lane order of `docs/numerics.md`.
/// `group.len()` is a multiple of [`LANES`] (groups are padded). Always inlined, so that it
/// takes the target features of `mse_row`'s clone: `pow_p`'s `mul_add` is one instruction with
/// FMA and a libm call without it.
#[inline(always)]
pub fn candidate_loss(group: &[f32], scale: f32, zero: f32, maxq: f32, norm: f32) -> f32 {
    let p = GroupParams {
        scale,
        inv_scale: 1.0 / scale,
        zero,
        maxq,
    };
    let mut lanes = [0f32; LANES];
    let err = |x: f32| p.dequant(p.code(x)) - x;
    if norm == 2.0 {
        for chunk in group.chunks_exact(LANES) {
            for (acc, &x) in lanes.iter_mut().zip(chunk) {
                let e = err(x);
                *acc += e * e;
            }
        }
    } else {
        for chunk in group.chunks_exact(LANES) {
            for (acc, &x) in lanes.iter_mut().zip(chunk) {
                *acc += pow_p(err(x).abs(), norm);
            }
        }
    }
    let mut off = LANES / 2;
    while off > 0 {
        for l in 0..off {
            lanes[l] += lanes[l + off];
        }
        off /= 2;
    }
    lanes[0]
}

/// The qmeta4 log2 field of candidate `p` around the base scale `s0`: the candidate scale
/// is `decode(encode(max(s0 * p, SCALE_MIN)))`, i.e. exactly the scale that would be stored.
#[inline]
pub fn candidate_q88(s0: f32, p: f32) -> i16 {
    encode_log2_q88((s0 * p).max(SCALE_MIN))
}

/// Best candidate for one group: returns the refined qmeta.
///
/// Every candidate is evaluated at the scale it would be stored as (Q8.8-rounded), so the
/// loss of the stored qmeta is exactly the minimum found. The zero point stays that of the
/// range grid: GPTQ's reference search shrinks `xmin` and `xmax` by the same factor `p`, and
/// `round(-p·xmin / (p·(xmax − xmin)/maxq))` does not depend on `p`.
#[inline(always)]
pub fn mse_refine_group(group: &[f32], meta: QMeta, bits: u8, cands: &[f32], norm: f32) -> QMeta {
    let p = meta.params(bits);
    let mut best = f32::INFINITY;
    let mut best_q = meta.log2_q88();
    for &c in cands {
        let q = candidate_q88(p.scale, c);
        let loss = candidate_loss(group, decode_scale(q), p.zero, p.maxq, norm);
        if loss < best {
            best = loss;
            best_q = q;
        }
    }
    QMeta::new(best_q, meta.zero(), meta.flags() & FLAG_SYMMETRIC)
}

/// Refines `qmeta` in place with the MSE / L^p shrink search.
pub fn refine_mse<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    spec: &GridSpec,
    mse: &MseSpec,
    qmeta: &mut [QMeta],
) -> Result<()> {
    check_inputs(x, rows, cols, spec)?;
    mse.validate()?;
    let ng = spec.groups(cols);
    check_len("qmeta", qmeta.len(), rows, ng)?;
    let cands = mse.candidates();
    qmeta
        .par_chunks_mut(ng)
        .zip(x.par_chunks(cols))
        .for_each_init(
            || vec![0f32; spec.group_size],
            |buf, (meta_row, row)| mse_row(row, meta_row, spec, &cands, mse.norm, buf),
        );
    Ok(())
}

/// How to choose the scales.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GridMode {
    /// Min/max (absmax for symmetric) of each group.
    Range,
    /// Range, then the MSE / L^p shrink search.
    Mse(MseSpec),
}

/// Builds a grid: returns `(qmeta [rows * groups], maxq, pad)` as in spec §7.1.
pub fn build_quant_grid<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    spec: &GridSpec,
    mode: GridMode,
) -> Result<(Vec<QMeta>, u32, usize)> {
    let mut qmeta = build_range(x, rows, cols, spec)?;
    if let GridMode::Mse(mse) = mode {
        refine_mse(x, rows, cols, spec, &mse, &mut qmeta)?;
    }
    Ok((qmeta, spec.maxq(), spec.pad(cols)))
}

/// Round-to-nearest codes of `W [rows, cols]` on a grid, returned TRANSPOSED as
/// `[cols, rows]` (the `(C, R)` layout the GPTQ solver and the packers use).
pub fn quantize_rtn<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    spec: &GridSpec,
    qmeta: &[QMeta],
) -> Result<Vec<u8>> {
    check_inputs(x, rows, cols, spec)?;
    let ng = spec.groups(cols);
    check_len("qmeta", qmeta.len(), rows, ng)?;
    // codes_t[c][r]: compute row by row, then transpose in tiles.
    let mut codes = vec![0u8; rows * cols];
    codes
        .par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .zip(qmeta.par_chunks(ng))
        .for_each(|((out, row), meta_row)| rtn_row(row, meta_row, spec, out));
    Ok(transpose_u8(&codes, rows, cols))
}

/// Transposes a row-major `[rows, cols]` byte matrix.
pub fn transpose_u8(a: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut t = vec![0u8; rows * cols];
    const TB: usize = 64;
    t.par_chunks_mut((rows * TB).max(1))
        .enumerate()
        .for_each(|(bi, chunk)| {
            let c0 = bi * TB;
            let nc = chunk.len() / rows;
            for r in 0..rows {
                for dc in 0..nc {
                    chunk[dc * rows + r] = a[r * cols + c0 + dc];
                }
            }
        });
    t
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn range_asym_and_sym() {
        let spec = GridSpec {
            bits: 4,
            group_size: 32,
            symmetric: false,
        };
        let g: Vec<f32> = (0..32).map(|i| i as f32 / 31.0 * 3.0 - 1.0).collect();
        let m = range_meta(&g, &spec);
        let s = 3.0f32 / 15.0 + EPS;
        assert!((m.scale() / s - 1.0).abs() < 2e-3);
        assert_eq!(m.zero(), 5); // round(1/0.2)
        let spec = GridSpec {
            symmetric: true,
            ..spec
        };
        let m = range_meta(&g, &spec);
        assert_eq!(m.zero(), 8);
        assert!(m.symmetric());
    }

    /// Round-to-nearest dequantization of one group with its qmeta (plain formula).
    fn dequant(g: &[f32], m: QMeta, bits: u8) -> Vec<f32> {
        let p = m.params(bits);
        g.iter()
            .map(|&x| {
                let q = (x / p.scale + p.zero).round().clamp(0.0, p.maxq);
                (q - p.zero) * p.scale
            })
            .collect()
    }

    #[test]
    fn one_signed_groups_keep_zero_in_the_grid() {
        // Values in [0.4, 0.6] (and their negatives): the grid spans [0, 0.6], so the error
        // is at most half a step of 0.6 / 15; a clamped zero point gave ~60 % errors.
        for sign in [1.0f32, -1.0] {
            for symmetric in [false, true] {
                let spec = GridSpec {
                    bits: 4,
                    group_size: 32,
                    symmetric,
                };
                let g: Vec<f32> = (0..32)
                    .map(|i| sign * (0.4 + 0.2 * i as f32 / 31.0))
                    .collect();
                let m = range_meta(&g, &spec);
                let step = if symmetric { 1.2 / 15.0 } else { 0.6 / 15.0 };
                let err = dequant(&g, m, 4)
                    .iter()
                    .zip(&g)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    err <= 0.5 * step * 1.01,
                    "sign {sign} sym {symmetric}: {err}"
                );
                if !symmetric {
                    assert_eq!(m.zero(), if sign > 0.0 { 0 } else { 15 });
                }
            }
        }
    }

    #[test]
    fn zero_and_tiny_groups_store_a_positive_fp16_scale() {
        for symmetric in [false, true] {
            let spec = GridSpec {
                bits: 4,
                group_size: 32,
                symmetric,
            };
            for v in [0.0f32, 1e-30, -3e-12, 1e-8] {
                let g = vec![v; 32];
                for m in [
                    range_meta(&g, &spec),
                    mse_refine_group(
                        &g,
                        range_meta(&g, &spec),
                        4,
                        &MseSpec::default().candidates(),
                        2.4,
                    ),
                ] {
                    let h = half::f16::from_f32(m.scale());
                    assert!(h.to_f32() > 0.0, "{v}: fp16 scale {h}");
                    assert!(m.scale() >= SCALE_MIN);
                    let err = dequant(&g, m, 4)[0] - v;
                    assert!(err.abs() <= 0.5 * m.scale(), "{v}: {err}");
                    if v == 0.0 {
                        assert_eq!(err, 0.0);
                    }
                }
            }
        }
        assert_eq!(encode_log2_q88(SCALE_MIN), -6144);
        assert_eq!(decode_scale(-6144), SCALE_MIN);
    }

    #[test]
    fn mse_stored_loss_is_the_minimum_found() {
        // The stored (Q8.8) scale is the one evaluated: with p = 1.0 among the candidates the
        // stored loss can never exceed the range loss, exactly.
        let spec = GridSpec {
            bits: 4,
            group_size: 64,
            symmetric: false,
        };
        let cands = MseSpec {
            n_grid: 101,
            ..Default::default()
        }
        .candidates();
        assert_eq!(cands[50], 1.0);
        for seed in 0..64u32 {
            let g: Vec<f32> = (0..64)
                .map(|i| {
                    let h = (i as u32)
                        .wrapping_mul(2_654_435_761)
                        .wrapping_add(seed * 40_503)
                        % 10_007;
                    (h as f32 / 5003.5 - 1.0).powi(3) + if seed % 3 == 0 { 0.7 } else { 0.0 }
                })
                .collect();
            let m0 = range_meta(&g, &spec);
            let m = mse_refine_group(&g, m0, 4, &cands, 2.4);
            let l = |m: QMeta| {
                let p = m.params(4);
                candidate_loss(&g, p.scale, p.zero, p.maxq, 2.4)
            };
            assert!(l(m) <= l(m0), "seed {seed}: {} > {}", l(m), l(m0));
        }
    }

    #[test]
    fn transpose() {
        let a: Vec<u8> = (0..(5 * 130)).map(|i| (i % 251) as u8).collect();
        let t = transpose_u8(&a, 5, 130);
        for r in 0..5 {
            for c in 0..130 {
                assert_eq!(t[c * 5 + r], a[r * 130 + c]);
            }
        }
    }

    #[test]
    fn mse_never_worse_than_range() {
        let spec = GridSpec {
            bits: 4,
            group_size: 64,
            symmetric: false,
        };
        let x: Vec<f32> = (0..64 * 8)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0).powi(3))
            .collect();
        let mut q = build_range(&x, 8, 64, &spec).unwrap();
        let before = q.clone();
        refine_mse(
            &x,
            8,
            64,
            &spec,
            &MseSpec {
                norm: 2.0,
                ..Default::default()
            },
            &mut q,
        )
        .unwrap();
        for r in 0..8 {
            let g = &x[r * 64..(r + 1) * 64];
            let lb = before[r].params(4);
            let la = q[r].params(4);
            let eb = candidate_loss(g, lb.scale, lb.zero, 15.0, 2.0);
            let ea = candidate_loss(g, la.scale, la.zero, 15.0, 2.0);
            assert!(ea <= eb * 1.002, "{ea} {eb}");
        }
    }
}
