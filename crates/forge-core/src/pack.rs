//! int4 packing: vLLM AWQ "gemm" layout and GPTQ v1 layout (facts: shared/notes/formats.md).
//!
//! `K` = in_features, `N` = out_features, `G` = group size. Codes are `K × N` bytes (the
//! `(C, R)` layout of the GPTQ solver); qmeta is the grid of `W [N, K]`, `N × K/G`.

use crate::dtype::{check_finite, Element};
use crate::error::{check_len, Error, Result};
use crate::grid::GridSpec;
use crate::qmeta::QMeta;
use half::f16;
use rayon::prelude::*;

/// Nibble `i` of an AWQ word holds column `8c + AWQ_ORDER[i]`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
/// Inverse of [`AWQ_ORDER`]: column `j` of a pack sits in nibble `AWQ_REVERSE[j]`.
pub const AWQ_REVERSE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// A linear layer in vLLM's AWQ layout.
#[derive(Clone, Debug, PartialEq)]
pub struct AwqTensors {
    /// `int32 [K, N/8]`.
    pub qweight: Vec<i32>,
    /// `int32 [K/G, N/8]`, raw zero points, same nibble order.
    pub qzeros: Vec<i32>,
    /// `fp16 [K/G, N]`.
    pub scales: Vec<f16>,
}

/// A linear layer in the GPTQ v1 layout.
#[derive(Clone, Debug, PartialEq)]
pub struct GptqTensors {
    /// `int32 [K/8, N]`, packed along the input dimension in plain order.
    pub qweight: Vec<i32>,
    /// `int32 [K/G, N/8]`, plain order, storing `zero - 1`.
    pub qzeros: Vec<i32>,
    /// `fp16 [K/G, N]`.
    pub scales: Vec<f16>,
    /// `int32 [K]`, `k / G`.
    pub g_idx: Vec<i32>,
}

/// Checks what the packed 4-bit layouts need: 4 bits, `N % 8 == 0`, `K % G == 0`.
pub fn check_pack_shape(k: usize, n: usize, spec: &GridSpec) -> Result<()> {
    spec.validate()?;
    if spec.bits != 4 {
        return Err(Error::param(
            "bits",
            "packing supports 4-bit codes only",
            spec.bits,
        ));
    }
    if n == 0 || !n.is_multiple_of(8) {
        return Err(Error::shape("out_features", "a positive multiple of 8", n));
    }
    if k == 0 || !k.is_multiple_of(spec.group_size) {
        return Err(Error::shape(
            "in_features",
            format!("a positive multiple of group_size {}", spec.group_size),
            k,
        ));
    }
    Ok(())
}

/// fp16 scale of a group; errors when it does not fit fp16 or would round to 0
/// (grids built by forge never store a scale below `grid::SCALE_MIN` = 2^-24).
fn scale16(m: QMeta, row: usize, group: usize) -> Result<f16> {
    let s = m.scale();
    let h = f16::from_f32(s);
    if !h.is_finite() {
        return Err(Error::param(
            "qmeta",
            format!("scale of output {row}, group {group} does not fit fp16 (max 65504)"),
            s,
        ));
    }
    if h.to_f32() <= 0.0 {
        return Err(Error::param(
            "qmeta",
            format!("scale of output {row}, group {group} rounds to an fp16 scale of 0 (smallest positive fp16 is 2^-24)"),
            s,
        ));
    }
    Ok(h)
}

/// Zero points `[K/G, N]` and fp16 scales `[K/G, N]` from a grid `N × K/G`.
pub fn scales_and_zeros(
    qmeta: &[QMeta],
    k: usize,
    n: usize,
    spec: &GridSpec,
) -> Result<(Vec<u8>, Vec<f16>)> {
    let ng = k / spec.group_size;
    check_len("qmeta", qmeta.len(), n, ng)?;
    let mut zeros = vec![0u8; ng * n];
    let mut scales = vec![f16::ZERO; ng * n];
    for row in 0..n {
        for g in 0..ng {
            let m = qmeta[row * ng + g];
            let z = m.zero_point(spec.bits);
            if z > spec.maxq() {
                return Err(Error::param(
                    "qmeta",
                    format!(
                        "zero point of output {row}, group {g} must be <= {} for {}-bit codes",
                        spec.maxq(),
                        spec.bits
                    ),
                    z,
                ));
            }
            zeros[g * n + row] = z as u8;
            scales[g * n + row] = scale16(m, row, g)?;
        }
    }
    Ok((zeros, scales))
}

/// Packs 8 codes of consecutive columns into one AWQ word.
#[inline(always)]
pub fn awq_word(v: &[u8]) -> i32 {
    let mut w = 0u32;
    for (i, &col) in AWQ_ORDER.iter().enumerate() {
        w |= ((v[col] & 0xF) as u32) << (4 * i);
    }
    w as i32
}

/// Packs a `rows × n` byte matrix along its columns in AWQ order.
fn awq_pack_rows(v: &[u8], rows: usize, n: usize) -> Vec<i32> {
    let mut out = vec![0i32; rows * n / 8];
    out.par_chunks_mut(n / 8).enumerate().for_each(|(r, o)| {
        for (c, w) in o.iter_mut().enumerate() {
            *w = awq_word(&v[r * n + 8 * c..r * n + 8 * c + 8]);
        }
    });
    out
}

/// Unpacks AWQ words `rows × n/8` into bytes `rows × n`.
fn awq_unpack_rows(p: &[i32], rows: usize, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * n];
    out.par_chunks_mut(n).enumerate().for_each(|(r, o)| {
        for c in 0..n / 8 {
            let w = p[r * (n / 8) + c] as u32;
            for (i, &col) in AWQ_ORDER.iter().enumerate() {
                o[8 * c + col] = ((w >> (4 * i)) & 0xF) as u8;
            }
        }
    });
    out
}

fn check_codes(codes: &[u8], maxq: u32) -> Result<()> {
    if let Some(i) = codes.par_iter().position_first(|&q| q as u32 > maxq) {
        return Err(Error::param(
            "codes",
            format!("must be <= {maxq}; index {i} is not"),
            codes[i],
        ));
    }
    Ok(())
}

/// Packs GPTQ/RTN codes (`K × N`) with their grid into the AWQ layout.
pub fn pack_awq(
    codes: &[u8],
    qmeta: &[QMeta],
    k: usize,
    n: usize,
    spec: &GridSpec,
) -> Result<AwqTensors> {
    check_pack_shape(k, n, spec)?;
    check_len("codes", codes.len(), k, n)?;
    check_codes(codes, spec.maxq())?;
    let (zeros, scales) = scales_and_zeros(qmeta, k, n, spec)?;
    Ok(AwqTensors {
        qweight: awq_pack_rows(codes, k, n),
        qzeros: awq_pack_rows(&zeros, k / spec.group_size, n),
        scales,
    })
}

/// Fused round-to-nearest quantize + AWQ pack of `W [N, K]` on its grid (one read of W).
pub fn quantize_pack_awq<T: Element>(
    w: &[T],
    qmeta: &[QMeta],
    n: usize,
    k: usize,
    spec: &GridSpec,
) -> Result<AwqTensors> {
    check_pack_shape(k, n, spec)?;
    check_len("weight", w.len(), n, k)?;
    check_finite("weight", w)?;
    let ng = k / spec.group_size;
    check_len("qmeta", qmeta.len(), n, ng)?;
    let (zeros, scales) = scales_and_zeros(qmeta, k, n, spec)?;
    let mut qweight = vec![0i32; k * n / 8];
    // One task per group of 8 output rows: a column of words.
    let cols: Vec<Vec<i32>> = (0..n / 8)
        .into_par_iter()
        .map(|c| {
            let mut col = vec![0i32; k];
            let mut v = [0u8; 8];
            let params: Vec<_> = (0..8)
                .map(|j| {
                    (0..ng)
                        .map(|g| qmeta[(8 * c + j) * ng + g].params(spec.bits))
                        .collect::<Vec<_>>()
                })
                .collect();
            for (kk, out) in col.iter_mut().enumerate() {
                let g = kk / spec.group_size;
                for j in 0..8 {
                    let p = &params[j][g];
                    v[j] = p.code(w[(8 * c + j) * k + kk].to_f32()) as u8;
                }
                *out = awq_word(&v);
            }
            col
        })
        .collect();
    for (c, col) in cols.iter().enumerate() {
        for (kk, &word) in col.iter().enumerate() {
            qweight[kk * (n / 8) + c] = word;
        }
    }
    Ok(AwqTensors {
        qweight,
        qzeros: awq_pack_rows(&zeros, ng, n),
        scales,
    })
}

/// Shape checks shared by the unpackers (the GPTQ v1 layout also packs K by 8).
fn check_unpack_shape(k: usize, n: usize, group_size: usize, gptq_layout: bool) -> Result<()> {
    let spec = GridSpec {
        bits: 4,
        group_size,
        symmetric: false,
    };
    check_pack_shape(k, n, &spec)?;
    if gptq_layout && !k.is_multiple_of(8) {
        return Err(Error::shape("in_features", "a multiple of 8", k));
    }
    Ok(())
}

/// Unpacks an AWQ layer: returns `(codes K × N, zeros K/G × N)`.
pub fn unpack_awq(
    qweight: &[i32],
    qzeros: &[i32],
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<(Vec<u8>, Vec<u8>)> {
    check_unpack_shape(k, n, group_size, false)?;
    check_len("qweight", qweight.len(), k, n / 8)?;
    check_len("qzeros", qzeros.len(), k / group_size, n / 8)?;
    Ok((
        awq_unpack_rows(qweight, k, n),
        awq_unpack_rows(qzeros, k / group_size, n),
    ))
}

/// Packs codes (`K × N`) with their grid into the GPTQ v1 layout (`desc_act = false`).
pub fn pack_gptq(
    codes: &[u8],
    qmeta: &[QMeta],
    k: usize,
    n: usize,
    spec: &GridSpec,
) -> Result<GptqTensors> {
    check_pack_shape(k, n, spec)?;
    if !k.is_multiple_of(8) {
        return Err(Error::shape("in_features", "a multiple of 8", k));
    }
    check_len("codes", codes.len(), k, n)?;
    check_codes(codes, spec.maxq())?;
    let (zeros, scales) = scales_and_zeros(qmeta, k, n, spec)?;
    if let Some(i) = zeros.iter().position(|&z| z == 0) {
        return Err(Error::param(
            "qmeta",
            format!(
                "GPTQ v1 stores zero - 1 and cannot represent zero point 0 (group {}, output {}); use the AWQ layout or a symmetric grid",
                i / n,
                i % n
            ),
            0,
        ));
    }
    let mut qweight = vec![0i32; k / 8 * n];
    qweight.par_chunks_mut(n).enumerate().for_each(|(rr, out)| {
        for (col, o) in out.iter_mut().enumerate() {
            let mut w = 0u32;
            for i in 0..8 {
                w |= (codes[(8 * rr + i) * n + col] as u32 & 0xF) << (4 * i);
            }
            *o = w as i32;
        }
    });
    let ng = k / spec.group_size;
    let mut qzeros = vec![0i32; ng * n / 8];
    for g in 0..ng {
        for c in 0..n / 8 {
            let mut w = 0u32;
            for i in 0..8 {
                w |= ((zeros[g * n + 8 * c + i] - 1) as u32 & 0xF) << (4 * i);
            }
            qzeros[g * (n / 8) + c] = w as i32;
        }
    }
    let g_idx = (0..k).map(|kk| (kk / spec.group_size) as i32).collect();
    Ok(GptqTensors {
        qweight,
        qzeros,
        scales,
        g_idx,
    })
}

/// Unpacks a GPTQ v1 layer: returns `(codes K × N, zeros K/G × N)` with the `+1` undone.
pub fn unpack_gptq(
    qweight: &[i32],
    qzeros: &[i32],
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<(Vec<u8>, Vec<u8>)> {
    check_unpack_shape(k, n, group_size, true)?;
    check_len("qweight", qweight.len(), k / 8, n)?;
    let ng = k / group_size;
    check_len("qzeros", qzeros.len(), ng, n / 8)?;
    let mut codes = vec![0u8; k * n];
    for rr in 0..k / 8 {
        for col in 0..n {
            let w = qweight[rr * n + col] as u32;
            for i in 0..8 {
                codes[(8 * rr + i) * n + col] = ((w >> (4 * i)) & 0xF) as u8;
            }
        }
    }
    let mut zeros = vec![0u8; ng * n];
    for g in 0..ng {
        for c in 0..n / 8 {
            let w = qzeros[g * (n / 8) + c] as u32;
            for i in 0..8 {
                zeros[g * n + 8 * c + i] = (((w >> (4 * i)) & 0xF) + 1) as u8;
            }
        }
    }
    Ok((codes, zeros))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    #[test]
    fn awq_word_order() {
        let v = [0u8, 1, 2, 3, 4, 5, 6, 7];
        // nibbles hold columns 0,2,4,6,1,3,5,7
        assert_eq!(awq_word(&v) as u32, 0x7531_6420);
        let p = awq_pack_rows(&v, 1, 8);
        assert_eq!(awq_unpack_rows(&p, 1, 8), v.to_vec());
        for (j, &i) in AWQ_REVERSE.iter().enumerate() {
            assert_eq!(AWQ_ORDER[i], j);
        }
    }
}
