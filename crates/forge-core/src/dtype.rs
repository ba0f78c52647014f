//! Input element types and their exact conversion to f32.

use half::{bf16, f16};

/// An fp8 E4M3 (the `e4m3fn` variant: bias 7, no infinities, 0x7F/0xFF are NaN) value,
/// stored as its raw byte.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// Side length of the square blocks of DeepSeek-style FP8 `weight_scale_inv`: element
/// `[r, c]` of an F8_E4M3 weight is `e4m3(byte) · scale[r / FP8_BLOCK, c / FP8_BLOCK]`.
pub const FP8_BLOCK: usize = 128;

const fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    let v = if exp == 0 {
        // subnormal: man/8 * 2^-6
        man * (1.0 / 512.0)
    } else {
        let mut p = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            p *= 2.0;
            e -= 1;
        }
        while e < 0 {
            p *= 0.5;
            e += 1;
        }
        (1.0 + man / 8.0) * p
    };
    sign * v
}

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
}

/// Exact value of every fp8 E4M3 byte.
pub static E4M3_TABLE: [f32; 256] = build_e4m3_table();

/// `w [n, k]` (E4M3 bytes) times its block scales `scales [ceil(n/128), ceil(k/128)]` as f32,
/// row-major: `w[r, c] = e4m3(byte) · scales[r / FP8_BLOCK, c / FP8_BLOCK]`, one f32 multiply
/// (the value the CUDA kernels compute from the same bytes and scales). Rows in parallel.
///
/// # Panics
/// Never for slices of the stated lengths; checked and reported as shape errors.
pub fn dequantize_fp8_blocks(
    w: &[u8],
    scales: &[f32],
    n: usize,
    k: usize,
) -> crate::Result<Vec<f32>> {
    use rayon::prelude::*;
    let kb = k.div_ceil(FP8_BLOCK);
    if w.len() != n * k {
        return Err(crate::Error::shape(
            "weight",
            format!("{n} x {k} bytes"),
            w.len(),
        ));
    }
    if scales.len() != n.div_ceil(FP8_BLOCK) * kb {
        return Err(crate::Error::shape(
            "scale_inv",
            format!(
                "[{}, {kb}] for a {n} x {k} weight in {FP8_BLOCK}x{FP8_BLOCK} blocks",
                n.div_ceil(FP8_BLOCK)
            ),
            scales.len(),
        ));
    }
    let mut out = vec![0.0f32; n * k];
    if k == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(k)
        .zip(w.par_chunks(k))
        .enumerate()
        .for_each(|(r, (row, src))| {
            let srow = &scales[r / FP8_BLOCK * kb..(r / FP8_BLOCK + 1) * kb];
            for ((o, b), &sc) in row
                .chunks_mut(FP8_BLOCK)
                .zip(src.chunks(FP8_BLOCK))
                .zip(srow)
            {
                for (o, &b) in o.iter_mut().zip(b) {
                    *o = E4M3_TABLE[usize::from(b)] * sc;
                }
            }
        });
    Ok(out)
}

/// An element type the quantizers accept. Conversion to f32 is exact for all of them.
pub trait Element: Copy + Send + Sync + 'static {
    /// Short name used in error messages (`"bf16"`).
    const NAME: &'static str;
    /// Exact conversion.
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl Element for f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}
impl Element for bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl Element for F8E4M3 {
    const NAME: &'static str = "f8_e4m3";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        E4M3_TABLE[self.0 as usize]
    }
}

/// Returns the index and value of the first non-finite element, if any.
pub fn first_non_finite<T: Element>(x: &[T]) -> Option<(usize, f32)> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    // Chunks are scanned with a branch-free test (vectorised); only a failing chunk is
    // searched for the first offending index.
    let bad_chunk = x
        .par_chunks(CHUNK)
        .position_first(|c| !chunk_all_finite(c))?;
    let start = bad_chunk * CHUNK;
    x[start..]
        .iter()
        .position(|v| !v.to_f32().is_finite())
        .map(|i| (start + i, x[start + i].to_f32()))
}

#[multiversion::multiversion(targets("x86_64+avx2+fma", "x86_64+sse4.1"))]
fn chunk_all_finite<T: Element>(c: &[T]) -> bool {
    // v * 0 == 0 exactly for finite v, NaN for ±inf and NaN
    let mut ok = true;
    for v in c {
        ok &= v.to_f32() * 0.0 == 0.0;
    }
    ok
}

/// Errors with [`crate::Error::NonFinite`] if `x` holds NaN or infinity.
pub fn check_finite<T: Element>(name: &str, x: &[T]) -> crate::Result<()> {
    match first_non_finite(x) {
        Some((index, value)) => Err(crate::Error::NonFinite {
            name: name.into(),
            index,
            value,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fp8_blocks_dequantize_per_block_and_check_shapes() {
        // 130 x 260: two row blocks and three column blocks, the last ones partial.
        let (n, k) = (130usize, 260usize);
        let w: Vec<u8> = (0..n * k).map(|i| (i * 37 % 251) as u8 & 0x7E).collect();
        let scales: Vec<f32> = (0..6).map(|i| 0.5 + i as f32).collect();
        let got = dequantize_fp8_blocks(&w, &scales, n, k).unwrap();
        for r in 0..n {
            for c in 0..k {
                let want = E4M3_TABLE[w[r * k + c] as usize] * scales[(r / 128) * 3 + c / 128];
                assert_eq!(got[r * k + c].to_bits(), want.to_bits(), "[{r}, {c}]");
            }
        }
        assert!(dequantize_fp8_blocks(&w, &scales[..5], n, k).is_err());
        assert!(dequantize_fp8_blocks(&w[1..], &scales, n, k).is_err());
    }
    #[test]
    fn e4m3_known_values() {
        assert_eq!(E4M3_TABLE[0x00], 0.0);
        assert_eq!(E4M3_TABLE[0x38], 1.0); // exp 7, man 0
        assert_eq!(E4M3_TABLE[0x7E], 448.0); // max normal
        assert_eq!(E4M3_TABLE[0x01], 2f32.powi(-9)); // min subnormal
        assert_eq!(E4M3_TABLE[0xB8], -1.0);
        assert!(E4M3_TABLE[0x7F].is_nan() && E4M3_TABLE[0xFF].is_nan());
    }

    /// Every byte against the format's definition (OCP FP8 E4M3 "fn": sign, 4 exponent bits
    /// of bias 7, 3 mantissa bits, subnormals at exponent 0, NaN at S.1111.111, no infinity),
    /// computed here in f64: the table the CPU and the CUDA kernels share.
    #[test]
    fn e4m3_table_is_the_format_definition() {
        for b in 0..=255u8 {
            let (sign, e, m) = (b >> 7, i32::from((b >> 3) & 15), f64::from(b & 7));
            let v = E4M3_TABLE[b as usize];
            if e == 15 && m == 7.0 {
                assert!(v.is_nan(), "{b:#04x}");
                continue;
            }
            let mag = if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            let want = if sign == 1 { -mag } else { mag } as f32;
            assert_eq!(v.to_bits(), want.to_bits(), "{b:#04x}");
        }
    }
}
