//! int4 packing: vLLM AWQ "gemm" layout, GPTQ v1 layout and compressed-tensors
//! `pack-quantized` (facts: shared/notes/formats.md).
//!
//! `K` = in_features, `N` = out_features, `G` = group size. Codes are `K × N` bytes (the
//! `(C, R)` layout of the GPTQ solver); qmeta is the grid of `W [N, K]`, `N × K/G`.

use crate::dtype::{check_finite, Element};
use crate::error::{check_len, Error, Result};
use crate::grid::{rtn_row, GridSpec};
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

/// Refuses codes above `maxq`, naming the first. Chunks are scanned with a branch-free
/// maximum (vectorised) and only a failing chunk is searched: a per-element
/// `par_iter().position_first` ran at ~110 M codes/s on 2 cores (130 ms per DeepSeek-V3
/// expert projection, 100 CPU-seconds per MoE layer, which the GPU run waited for).
fn check_codes(codes: &[u8], maxq: u32) -> Result<()> {
    const CHUNK: usize = 1 << 16;
    let Some(bad) = codes
        .par_chunks(CHUNK)
        .position_first(|c| c.iter().fold(0u8, |m, &q| m.max(q)) as u32 > maxq)
    else {
        return Ok(());
    };
    let start = bad * CHUNK;
    let i = start
        + codes[start..]
            .iter()
            .position(|&q| q as u32 > maxq)
            .unwrap_or(0);
    Err(Error::param(
        "codes",
        format!("must be <= {maxq}; index {i} is not"),
        codes[i],
    ))
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
    // One task per group of 8 output rows: their codes row by row (vectorised, as
    // quantize_rtn), then a column of words.
    let cols: Vec<Vec<i32>> = (0..n / 8)
        .into_par_iter()
        .map(|c| {
            let mut codes = vec![0u8; 8 * k];
            for (j, out) in codes.chunks_exact_mut(k).enumerate() {
                let r = 8 * c + j;
                rtn_row(
                    &w[r * k..(r + 1) * k],
                    &qmeta[r * ng..(r + 1) * ng],
                    spec,
                    out,
                );
            }
            let mut v = [0u8; 8];
            (0..k)
                .map(|kk| {
                    for (j, vj) in v.iter_mut().enumerate() {
                        *vj = codes[j * k + kk];
                    }
                    awq_word(&v)
                })
                .collect()
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

/// Output features of one tile of the tile layout ([`tile_awq`]).
pub const TILE_N: usize = 16;
/// Input features of one chunk of the tile layout ([`tile_awq`]).
pub const TILE_K: usize = 64;

/// Where nibble `p` of tile-layout word `i` (of a tensor with `chunks = K/64`) comes from:
/// `(k, n)` of the AWQ code. The layout's one definition; see [`tile_awq`].
fn tile_source(i: usize, chunks: usize, p: usize) -> (usize, usize) {
    let (j, lane, c, t) = (i & 3, (i >> 2) & 31, (i >> 7) % chunks, (i >> 7) / chunks);
    let (g, tt, r, e) = (lane >> 2, lane & 3, p & 3, p >> 2);
    (
        TILE_K * c + 16 * tt + 4 * j + 2 * (r >> 1) + e,
        TILE_N * t + g + 8 * (r & 1),
    )
}

/// Repacks an AWQ `qweight [K, N/8]` into the tile layout the CUDA tiled GEMV reads
/// (`cuda/gemm.cu`): `[N/16][K/64][32 lanes][4 steps]` words, where word
/// `(t, c, lane = 4g + tt, j)` holds in nibble `p` (`r = p & 3`, `e = p >> 2`) the code of
/// output `n = 16t + g + 8(r & 1)` at input `k = 64c + 16tt + 4j + 2(r >> 1) + e` — lane
/// `(g, tt)`'s A fragment of `mma.m16n8k16` for step `j` of chunk `c`, with the MMA's k
/// index permuted inside each step so that lane `tt` reads x at `16tt + 4j .. +3`. A pure
/// permutation of the nibbles (the word count is unchanged); `N % 16 == 0`, `K % 64 == 0`.
pub fn tile_awq(qweight: &[i32], k: usize, n: usize) -> Result<Vec<i32>> {
    if n == 0 || !n.is_multiple_of(TILE_N) {
        return Err(Error::shape("out_features", "a positive multiple of 16", n));
    }
    if k == 0 || !k.is_multiple_of(TILE_K) {
        return Err(Error::shape("in_features", "a positive multiple of 64", k));
    }
    check_len("qweight", qweight.len(), k, n / 8)?;
    let (nw, chunks) = (n / 8, k / TILE_K);
    let mut out = vec![0i32; qweight.len()];
    out.par_chunks_mut(chunks * 128)
        .enumerate()
        .for_each(|(t, tile)| {
            for (i, word) in tile.iter_mut().enumerate() {
                let mut w = 0u32;
                for p in 0..8 {
                    let (kk, nn) = tile_source(t * chunks * 128 + i, chunks, p);
                    let q = (qweight[kk * nw + nn / 8] as u32 >> (4 * AWQ_REVERSE[nn % 8])) & 15;
                    w |= q << (4 * p);
                }
                *word = w as i32;
            }
        });
    Ok(out)
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
    check_len("codes", codes.len(), k, n)?;
    check_codes(codes, spec.maxq())?;
    let (zeros, scales) = scales_and_zeros(qmeta, k, n, spec)?;
    gptq_from_parts(codes, &zeros, scales, k, n, spec.group_size)
}

/// The GPTQ v1 layout from codes `K × N`, zero points `K/G × N` and fp16 scales `K/G × N`
/// (what [`scales_and_zeros`] and [`awq_to_parts`] give).
pub fn gptq_from_parts(
    codes: &[u8],
    zeros: &[u8],
    scales: Vec<f16>,
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<GptqTensors> {
    check_unpack_shape(k, n, group_size, true)?;
    let ng = k / group_size;
    check_len("codes", codes.len(), k, n)?;
    check_len("zeros", zeros.len(), ng, n)?;
    check_len("scales", scales.len(), ng, n)?;
    if let Some(i) = zeros.iter().position(|&z| z == 0 || z > 15) {
        return Err(Error::param(
            "qmeta",
            format!(
                "GPTQ v1 stores zero - 1 in 4 bits and cannot represent zero point {} (group {}, output {}); use the AWQ layout or a symmetric grid",
                zeros[i],
                i / n,
                i % n
            ),
            zeros[i],
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
    let g_idx = (0..k).map(|kk| (kk / group_size) as i32).collect();
    Ok(GptqTensors {
        qweight,
        qzeros,
        scales,
        g_idx,
    })
}

/// A linear layer in the compressed-tensors `pack-quantized` layout (4-bit int, group strategy).
#[derive(Clone, Debug, PartialEq)]
pub struct CompressedTensors {
    /// `int32 [N, K/8]`, packed along the input dimension in plain order, values
    /// `int4 + 8` (= the unsigned code).
    pub weight_packed: Vec<i32>,
    /// `fp16 [N, K/G]`.
    pub weight_scale: Vec<f16>,
    /// `int64 [2]` = `[N, K]`.
    pub weight_shape: [i64; 2],
    /// `int32 [N/8, K/G]`, packed along the output dimension in plain order, values
    /// `zero + 8` in the signed convention (= the unsigned zero point); `None` when symmetric.
    pub weight_zero_point: Option<Vec<i32>>,
}

/// Packs codes (`K × N`) with their grid into the compressed-tensors `pack-quantized` layout.
pub fn pack_compressed(
    codes: &[u8],
    qmeta: &[QMeta],
    k: usize,
    n: usize,
    spec: &GridSpec,
) -> Result<CompressedTensors> {
    check_pack_shape(k, n, spec)?;
    check_len("codes", codes.len(), k, n)?;
    check_codes(codes, spec.maxq())?;
    let (zeros, scales) = scales_and_zeros(qmeta, k, n, spec)?;
    compressed_from_parts(
        codes,
        &zeros,
        &scales,
        k,
        n,
        spec.group_size,
        spec.symmetric,
    )
}

/// The compressed-tensors layout from codes `K × N`, zero points `K/G × N` and fp16 scales
/// `K/G × N`. Symmetric: every zero point must be 8 (no zero-point tensor is written).
pub fn compressed_from_parts(
    codes: &[u8],
    zeros: &[u8],
    scales: &[f16],
    k: usize,
    n: usize,
    group_size: usize,
    symmetric: bool,
) -> Result<CompressedTensors> {
    check_unpack_shape(k, n, group_size, true)?;
    let ng = k / group_size;
    check_len("codes", codes.len(), k, n)?;
    check_len("zeros", zeros.len(), ng, n)?;
    check_len("scales", scales.len(), ng, n)?;
    if let Some(i) = zeros.iter().position(|&z| z > 15 || (symmetric && z != 8)) {
        return Err(Error::param(
            "qmeta",
            format!(
                "zero point of output {}, group {} is {}; a symmetric compressed-tensors checkpoint needs 8 (and 4 bits at most 15)",
                i % n,
                i / n,
                zeros[i]
            ),
            zeros[i],
        ));
    }
    let kp = k / 8;
    let mut weight_packed = vec![0i32; n * kp];
    // Blocks of ROWS output rows: each code row is read as one contiguous run of ROWS bytes
    // (reading one byte per code row for one output row at a time missed the cache: 30 ms
    // against 4 for AWQ on a DeepSeek-V3 expert projection).
    const ROWS: usize = 64;
    weight_packed
        .par_chunks_mut(kp * ROWS)
        .enumerate()
        .for_each(|(b, out)| {
            let (r0, rows) = (b * ROWS, out.len() / kp);
            let mut w = [0u32; ROWS];
            for c in 0..kp {
                w.fill(0);
                for i in 0..8 {
                    let at = (8 * c + i) * n + r0;
                    for (wr, &q) in w.iter_mut().zip(&codes[at..at + rows]) {
                        *wr |= (q as u32 & 0xF) << (4 * i);
                    }
                }
                for (r, &wr) in w[..rows].iter().enumerate() {
                    out[r * kp + c] = wr as i32;
                }
            }
        });
    let mut weight_scale = vec![f16::ZERO; n * ng];
    for g in 0..ng {
        for row in 0..n {
            weight_scale[row * ng + g] = scales[g * n + row];
        }
    }
    let weight_zero_point = (!symmetric).then(|| {
        let mut zp = vec![0i32; n / 8 * ng];
        for r in 0..n / 8 {
            for g in 0..ng {
                let mut w = 0u32;
                for i in 0..8 {
                    w |= (zeros[g * n + 8 * r + i] as u32 & 0xF) << (4 * i);
                }
                zp[r * ng + g] = w as i32;
            }
        }
        zp
    });
    Ok(CompressedTensors {
        weight_packed,
        weight_scale,
        weight_shape: [n as i64, k as i64],
        weight_zero_point,
    })
}

/// Unpacks a compressed-tensors layer: `(codes K × N, zeros K/G × N, scales K/G × N)`.
pub fn unpack_compressed(
    t: &CompressedTensors,
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<(Vec<u8>, Vec<u8>, Vec<f16>)> {
    check_unpack_shape(k, n, group_size, true)?;
    let ng = k / group_size;
    check_len("weight_packed", t.weight_packed.len(), n, k / 8)?;
    check_len("weight_scale", t.weight_scale.len(), n, ng)?;
    let mut codes = vec![0u8; k * n];
    for row in 0..n {
        for c in 0..k / 8 {
            let w = t.weight_packed[row * (k / 8) + c] as u32;
            for i in 0..8 {
                codes[(8 * c + i) * n + row] = ((w >> (4 * i)) & 0xF) as u8;
            }
        }
    }
    let mut zeros = vec![8u8; ng * n];
    if let Some(zp) = &t.weight_zero_point {
        check_len("weight_zero_point", zp.len(), n / 8, ng)?;
        for r in 0..n / 8 {
            for g in 0..ng {
                let w = zp[r * ng + g] as u32;
                for i in 0..8 {
                    zeros[g * n + 8 * r + i] = ((w >> (4 * i)) & 0xF) as u8;
                }
            }
        }
    }
    let mut scales = vec![f16::ZERO; ng * n];
    for row in 0..n {
        for g in 0..ng {
            scales[g * n + row] = t.weight_scale[row * ng + g];
        }
    }
    Ok((codes, zeros, scales))
}

/// Codes `K × N`, zero points `K/G × N` and scales `K/G × N` of an AWQ layer (exact: the
/// input of the other layouts' `*_from_parts`).
pub fn awq_to_parts(
    t: &AwqTensors,
    k: usize,
    n: usize,
    group_size: usize,
) -> Result<(Vec<u8>, Vec<u8>, Vec<f16>)> {
    let (codes, zeros) = unpack_awq(&t.qweight, &t.qzeros, k, n, group_size)?;
    check_len("scales", t.scales.len(), k / group_size, n)?;
    Ok((codes, zeros, t.scales.clone()))
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

    /// Inverse of [`tile_awq`] (for the round trip below).
    fn untile_awq(tiled: &[i32], k: usize, n: usize) -> Vec<i32> {
        let (nw, chunks) = (n / 8, k / TILE_K);
        let mut out = vec![0i32; tiled.len()];
        for (i, &word) in tiled.iter().enumerate() {
            for p in 0..8 {
                let (kk, nn) = tile_source(i, chunks, p);
                let q = (word as u32 >> (4 * p)) & 15;
                out[kk * nw + nn / 8] |= (q << (4 * AWQ_REVERSE[nn % 8])) as i32;
            }
        }
        out
    }

    /// The tile layout holds code `q[k][n]` at the word and nibble its documentation names
    /// (checked one code at a time from an AWQ tensor with a single non-zero code), and
    /// `untile_awq` inverts it.
    #[test]
    fn tile_layout_places_each_code() {
        let (k, n) = (128usize, 32usize);
        let nw = n / 8;
        for (kk, nn) in [
            (0usize, 0usize),
            (1, 8),
            (2, 1),
            (63, 15),
            (64, 16),
            (77, 23),
            (127, 31),
        ] {
            let mut qw = vec![0i32; k * nw];
            qw[kk * nw + nn / 8] = (9u32 << (4 * AWQ_REVERSE[nn % 8])) as i32;
            let tiled = tile_awq(&qw, k, n).unwrap();
            // Invert the documented map: t, c from n and k; then (g, r & 1) from n % 16 and
            // (tt, j, r >> 1, e) from k % 64.
            let (t, c, row, kin) = (nn / 16, kk / 64, nn % 16, kk % 64);
            let (g, r_lo) = (row % 8, row / 8);
            let (tt, j, r_hi, e) = (kin / 16, (kin % 16) / 4, (kin % 4) / 2, kin % 2);
            let (lane, p) = (4 * g + tt, (r_lo + 2 * r_hi) + 4 * e);
            let word = ((t * (k / 64) + c) * 32 + lane) * 4 + j;
            for (i, &w) in tiled.iter().enumerate() {
                let want = if i == word { 9u32 << (4 * p) } else { 0 };
                assert_eq!(w as u32, want, "code at k={kk} n={nn}: word {i}");
            }
            assert_eq!(untile_awq(&tiled, k, n), qw);
        }
        // A full random tensor round-trips.
        let mut state = 0x9e3779b9u32;
        let qw: Vec<i32> = (0..256 * 48 / 8)
            .map(|_| {
                state = state.wrapping_mul(1664525).wrapping_add(1013904223);
                state as i32
            })
            .collect();
        assert_eq!(untile_awq(&tile_awq(&qw, 256, 48).unwrap(), 256, 48), qw);
        assert!(tile_awq(&qw, 256, 40).is_err()); // wrong length and N % 16
        assert!(tile_awq(&qw[..(96 * 48 / 8)], 96, 48).is_err()); // K % 64
        assert!(tile_awq(&qw[..8], 256, 48).is_err()); // too short
    }
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

    #[test]
    fn codes_above_maxq_are_refused_naming_the_first() {
        let n = (1 << 16) * 3 + 40; // three whole scan chunks and a partial one
        let mut codes: Vec<u8> = (0..n).map(|i| (i % 16) as u8).collect();
        assert!(check_codes(&codes, 15).is_ok());
        for first in [5, (1 << 16) - 1, (1 << 16) * 2 + 7, n - 1] {
            let mut c = codes.clone();
            c[first] = 16;
            if first + 3 < n {
                c[first + 3] = 200; // a later bad code is not the one named
            }
            let msg = check_codes(&c, 15).unwrap_err().to_string();
            assert!(msg.contains(&format!("index {first} is not")), "{msg}");
        }
        // 2-bit codes: maxq 3
        codes.iter_mut().for_each(|q| *q &= 3);
        assert!(check_codes(&codes, 3).is_ok());
        codes[70_000] = 4;
        assert!(check_codes(&codes, 3)
            .unwrap_err()
            .to_string()
            .contains("index 70000 is not"));
    }

    /// The fused RTN + pack against the formula element by element: code =
    /// clamp(rne(x · (1/scale) + zero), 0, 15) on the element's group, words in AWQ order.
    fn fused_matches_formula<T: Element>(w: &[T], n: usize, k: usize, g: usize, sym: bool) {
        let spec = GridSpec {
            bits: 4,
            group_size: g,
            symmetric: sym,
        };
        let qm = crate::grid::build_range(w, n, k, &spec).unwrap();
        let t = quantize_pack_awq(w, &qm, n, k, &spec).unwrap();
        for kk in 0..k {
            for c in 0..n / 8 {
                let word = t.qweight[kk * (n / 8) + c] as u32;
                for (i, &col) in AWQ_ORDER.iter().enumerate() {
                    let r = 8 * c + col;
                    let p = qm[r * (k / g) + kk / g].params(4);
                    let x = w[r * k + kk].to_f32();
                    let want = (x * p.inv_scale + p.zero)
                        .round_ties_even()
                        .clamp(0.0, 15.0) as u32;
                    assert_eq!((word >> (4 * i)) & 0xF, want, "row {r}, input {kk}");
                }
            }
        }
    }

    #[test]
    fn fused_quantize_pack_follows_the_formula() {
        let (n, k, g) = (24, 192, 64);
        let vals = |i: usize| ((i * 7919 % 2003) as f32 - 1001.0) * 1e-3 * (1.0 + (i / k) as f32);
        let w32: Vec<f32> = (0..n * k).map(vals).collect();
        let w16: Vec<half::bf16> = w32.iter().map(|&x| half::bf16::from_f32(x)).collect();
        for sym in [false, true] {
            fused_matches_formula(&w32, n, k, g, sym);
            fused_matches_formula(&w16, n, k, g, sym);
        }
    }

    fn sample(k: usize, n: usize, g: usize, sym: bool) -> (Vec<u8>, Vec<u8>, Vec<f16>) {
        let codes: Vec<u8> = (0..k * n).map(|i| ((i * 7 + i / 13) % 16) as u8).collect();
        let zeros: Vec<u8> = (0..k / g * n)
            .map(|i| if sym { 8 } else { 1 + (i % 15) as u8 })
            .collect();
        let scales: Vec<f16> = (0..k / g * n)
            .map(|i| f16::from_f32(0.01 + i as f32 * 1e-3))
            .collect();
        (codes, zeros, scales)
    }

    #[test]
    fn compressed_round_trip_and_layout() {
        let (k, n, g) = (64, 16, 32);
        for sym in [true, false] {
            let (codes, zeros, scales) = sample(k, n, g, sym);
            let t = compressed_from_parts(&codes, &zeros, &scales, k, n, g, sym).unwrap();
            assert_eq!(t.weight_packed.len(), n * k / 8);
            assert_eq!(t.weight_scale.len(), n * k / g);
            assert_eq!(t.weight_shape, [n as i64, k as i64]);
            assert_eq!(t.weight_zero_point.is_none(), sym);
            // plain order along K: nibble i of word [row, c] is code [8c + i, row]
            let w = t.weight_packed[3 * (k / 8) + 2] as u32;
            for i in 0..8 {
                assert_eq!(((w >> (4 * i)) & 0xF) as u8, codes[(16 + i) * n + 3]);
            }
            assert_eq!(t.weight_scale[5 * (k / g) + 1], scales[n + 5]);
            let back = unpack_compressed(&t, k, n, g).unwrap();
            assert_eq!(back, (codes.clone(), zeros.clone(), scales.clone()));
        }
        // symmetric needs zero point 8 everywhere
        let (codes, zeros, scales) = sample(k, n, g, false);
        assert!(compressed_from_parts(&codes, &zeros, &scales, k, n, g, true).is_err());
    }

    #[test]
    fn compressed_packing_in_row_blocks_follows_the_layout() {
        // 136 output rows: two 64-row blocks and a partial one
        let (k, n, g) = (96, 136, 32);
        let (codes, zeros, scales) = sample(k, n, g, false);
        let t = compressed_from_parts(&codes, &zeros, &scales, k, n, g, false).unwrap();
        for row in 0..n {
            for c in 0..k / 8 {
                let w = t.weight_packed[row * (k / 8) + c] as u32;
                for i in 0..8 {
                    assert_eq!(((w >> (4 * i)) & 0xF) as u8, codes[(8 * c + i) * n + row]);
                }
            }
        }
    }

    #[test]
    fn gptq_from_awq_parts_matches_pack_gptq_layout() {
        let (k, n, g) = (64, 16, 32);
        let (codes, zeros, scales) = sample(k, n, g, false);
        let awq = AwqTensors {
            qweight: awq_pack_rows(&codes, k, n),
            qzeros: awq_pack_rows(&zeros, k / g, n),
            scales: scales.clone(),
        };
        let (c2, z2, s2) = awq_to_parts(&awq, k, n, g).unwrap();
        assert_eq!((&c2, &z2, &s2), (&codes, &zeros, &scales));
        let t = gptq_from_parts(&c2, &z2, s2, k, n, g).unwrap();
        assert_eq!(
            unpack_gptq(&t.qweight, &t.qzeros, k, n, g).unwrap(),
            (codes, zeros)
        );
        assert_eq!(t.g_idx, (0..k).map(|i| (i / g) as i32).collect::<Vec<_>>());
        let mut bad = z2.clone();
        bad[3] = 0;
        let (c3, _, s3) = sample(k, n, g, false);
        let e = gptq_from_parts(&c3, &bad, s3, k, n, g)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero point 0"), "{e}");
    }
}
