//! qmeta4: 4 bytes of quantization metadata per group.
//!
//! Byte layout (little endian), also readable as one `u32`:
//!
//! | bytes | bits of the u32 | field | meaning |
//! |---|---|---|---|
//! | 0..2 | 0..16 | `i16` | log2(scale) in Q8.8 (value / 256) |
//! | 2 | 16..24 | `u8` | zero point |
//! | 3 | 24..32 | `u8` | flags, bit 0 = symmetric, other bits 0 |
//!
//! Worked example: scale 0.01, zero 8, symmetric. log2(0.01) = −6.6439, × 256 = −1700.84,
//! rounded −1701 = `0xF95B`; bytes `5B F9 08 01`, u32 `0x0108F95B`; decodes to
//! 2^(−1701/256) = 0.0099953 (relative error 4.7e-4, within the Q8.8 bound 2^(1/512) − 1 = 1.4e-3).
//!
//! Encoding and decoding use only tables and exact bit manipulation, no transcendental
//! functions, so CPU and GPU produce identical bytes (see `docs/numerics.md`).

use std::sync::LazyLock;

/// Flag bit: the group is symmetric (zero point = (maxq + 1) / 2).
pub const FLAG_SYMMETRIC: u8 = 0x01;

/// The quantization tables shared with the CUDA kernels.
pub struct Tables {
    /// `THRESH[k] = f32(2^((k + 0.5) / 256))`: rounding thresholds of the mantissa.
    pub thresh: [f32; 256],
    /// `POW2[k] = f32(2^(k / 256))`: decoded mantissas.
    pub pow2: [f32; 256],
}

/// The tables, computed once in f64 and rounded to f32.
pub static TABLES: LazyLock<Tables> = LazyLock::new(|| {
    let mut thresh = [0f32; 256];
    let mut pow2 = [0f32; 256];
    for k in 0..256 {
        thresh[k] = 2f64.powf((k as f64 + 0.5) / 256.0) as f32;
        pow2[k] = 2f64.powf(k as f64 / 256.0) as f32;
    }
    Tables { thresh, pow2 }
});

/// Exact `2^e` as f32 for `e` in the normal range `[-126, 127]`.
#[inline(always)]
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `log2(scale)` in Q8.8, rounded to nearest in the log domain (ties up, by the table).
/// `scale` must be positive and finite; zero or negative gives `i16::MIN`, infinity or NaN
/// `i16::MAX` (callers validate before).
pub fn encode_log2_q88(scale: f32) -> i16 {
    if scale.is_nan() || scale == f32::INFINITY {
        return i16::MAX;
    }
    if scale <= 0.0 {
        return i16::MIN;
    }
    let mut bits = scale.to_bits();
    let mut e_adj = 0i32;
    if (bits >> 23) & 0xFF == 0 {
        // subnormal: normalise exactly
        bits = (scale * 8_388_608.0).to_bits(); // * 2^23
        e_adj = -23;
    }
    let e = ((bits >> 23) & 0xFF) as i32 - 127 + e_adj;
    let m = f32::from_bits((bits & 0x007F_FFFF) | 0x3F80_0000);
    let k = TABLES.thresh.partition_point(|&t| t <= m) as i32; // 0..=256
    let q = 256 * e + k;
    q.clamp(i16::MIN as i32, i16::MAX as i32) as i16
}

/// `2^(q / 256)` as f32, exactly reproducible: `POW2[q & 255] · 2^(q >> 8)`.
pub fn decode_scale(q: i16) -> f32 {
    let q = q as i32;
    let m = TABLES.pow2[(q & 255) as usize];
    let e = q >> 8; // -128..=127
    if e < -126 {
        (m * pow2i(e + 64)) * pow2i(-64)
    } else {
        m * pow2i(e)
    }
}

/// One group's metadata, as the little-endian `u32` view of the 4 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct QMeta(pub u32);

/// A decoded group: what the quantizer needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupParams {
    /// Scale.
    pub scale: f32,
    /// `1 / scale` (IEEE division).
    pub inv_scale: f32,
    /// Zero point.
    pub zero: f32,
    /// Largest code, `2^bits - 1`.
    pub maxq: f32,
}

impl QMeta {
    /// Builds from the three fields.
    pub fn new(log2_q88: i16, zero: u8, flags: u8) -> Self {
        QMeta((log2_q88 as u16 as u32) | ((zero as u32) << 16) | ((flags as u32) << 24))
    }
    /// Encodes a float scale.
    pub fn from_scale(scale: f32, zero: u8, symmetric: bool) -> Self {
        QMeta::new(
            encode_log2_q88(scale),
            zero,
            if symmetric { FLAG_SYMMETRIC } else { 0 },
        )
    }
    /// log2(scale) in Q8.8.
    pub fn log2_q88(self) -> i16 {
        (self.0 & 0xFFFF) as u16 as i16
    }
    /// Stored zero point.
    pub fn zero(self) -> u8 {
        ((self.0 >> 16) & 0xFF) as u8
    }
    /// Flags byte.
    pub fn flags(self) -> u8 {
        (self.0 >> 24) as u8
    }
    /// Symmetric flag.
    pub fn symmetric(self) -> bool {
        self.flags() & FLAG_SYMMETRIC != 0
    }
    /// Decoded scale.
    pub fn scale(self) -> f32 {
        decode_scale(self.log2_q88())
    }
    /// Zero point used by the quantizer: `(maxq + 1) / 2` for symmetric groups, the stored
    /// byte otherwise.
    pub fn zero_point(self, bits: u8) -> u32 {
        if self.symmetric() {
            1u32 << (bits - 1)
        } else {
            self.zero() as u32
        }
    }
    /// The four bytes, little endian.
    pub fn to_bytes(self) -> [u8; 4] {
        self.0.to_le_bytes()
    }
    /// From four little-endian bytes.
    pub fn from_bytes(b: [u8; 4]) -> Self {
        QMeta(u32::from_le_bytes(b))
    }
    /// Decodes everything the quantizer needs.
    #[inline]
    pub fn params(self, bits: u8) -> GroupParams {
        let scale = self.scale();
        GroupParams {
            scale,
            inv_scale: 1.0 / scale,
            zero: self.zero_point(bits) as f32,
            maxq: ((1u32 << bits) - 1) as f32,
        }
    }
}

impl GroupParams {
    /// The code of `x`: `clamp(rne(x * inv_scale + zero), 0, maxq)`.
    #[inline(always)]
    pub fn code(&self, x: f32) -> f32 {
        (x * self.inv_scale + self.zero)
            .round_ties_even()
            .clamp(0.0, self.maxq)
    }
    /// Dequantized value of a code: `(q - zero) * scale`.
    #[inline(always)]
    pub fn dequant(&self, q: f32) -> f32 {
        (q - self.zero) * self.scale
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn worked_example() {
        let m = QMeta::from_scale(0.01, 8, true);
        assert_eq!(m.log2_q88(), -1701);
        assert_eq!(m.to_bytes(), [0x5B, 0xF9, 0x08, 0x01]);
        assert_eq!(m.0, 0x0108_F95B);
        assert!((m.scale() - 0.009_995_32).abs() < 1e-8);
    }

    #[test]
    fn roundtrip_bound_all_magnitudes() {
        let bound = 2f64.powf(1.0 / 512.0) - 1.0;
        let mut s = 1e-30f32;
        while s < 1e30 {
            for f in [1.0f32, 1.1, 1.37, 1.5, 1.999] {
                let x = s * f;
                let d = decode_scale(encode_log2_q88(x));
                let rel = ((d as f64) - (x as f64)).abs() / x as f64;
                assert!(rel <= bound * 1.0001, "x={x} d={d} rel={rel}");
            }
            s *= 3.7;
        }
    }

    #[test]
    fn exact_powers_of_two() {
        for e in -120..120 {
            let x = 2f32.powi(e);
            assert_eq!(encode_log2_q88(x) as i32, 256 * e);
            assert_eq!(decode_scale(encode_log2_q88(x)), x);
        }
    }

    #[test]
    fn encode_matches_log2_rounding() {
        let mut s = 1e-6f32;
        while s < 1e6 {
            let want = ((s as f64).log2() * 256.0).round() as i32;
            let got = encode_log2_q88(s) as i32;
            assert!((got - want).abs() <= 1, "s={s}");
            s *= 1.0137;
        }
    }
}
