//! Portable `log2`, `exp2` and `pow` written with plain f32 `+ − * /` and bit
//! manipulation only, so that `cuda/common.cuh` (compiled with `--fmad=false`) computes
//! bit-identical values. Relative accuracy ≈ 1e-6, ample for a loss in a grid search.
//! Keep the operation sequence in sync with the CUDA mirror.

const SQRT2: f32 = std::f32::consts::SQRT_2; // 1.4142135f in the CUDA mirror
/// 2 / ln 2
const TWO_OVER_LN2: f32 = 2.885_39;
const LN2: f32 = std::f32::consts::LN_2; // 0.6931472f in the CUDA mirror

#[inline(always)]
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// log2 of a positive finite `a` (≤ 0 gives −inf, not used by callers). Written with
/// selects instead of branches so that it vectorises.
#[inline(always)]
pub fn log2_poly(a: f32) -> f32 {
    let sub = (a.to_bits() >> 23) & 0xFF == 0;
    let a2 = if sub { a * 8_388_608.0 } else { a };
    let bits = a2.to_bits();
    let e0 = ((bits >> 23) & 0xFF) as i32 - 127 - if sub { 23 } else { 0 };
    let m0 = f32::from_bits((bits & 0x007F_FFFF) | 0x3F80_0000);
    let big = m0 > SQRT2;
    let m = if big { m0 * 0.5 } else { m0 };
    let e = if big { e0 + 1 } else { e0 };
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    // atanh series: t + t^3/3 + t^5/5 + t^7/7 + t^9/9
    let s = 0.111_111_11f32;
    let s = s * t2 + 0.142_857_15;
    let s = s * t2 + 0.2;
    let s = s * t2 + 0.333_333_34;
    let s = s * t2 + 1.0;
    let r = (e as f32) + (t * s) * TWO_OVER_LN2;
    if a <= 0.0 {
        f32::NEG_INFINITY
    } else {
        r
    }
}

/// 2^y for finite `y` (underflows to 0 below −150, overflows to +inf at 128).
#[inline(always)]
pub fn exp2_poly(y: f32) -> f32 {
    let yc = y.clamp(-150.0, 127.0);
    let n = yc.round_ties_even();
    let x = (yc - n) * LN2; // |x| <= 0.347
                            // exp(x), Taylor to x^8
    let p = 2.480_158_7e-5f32; // 1/8!
    let p = p * x + 1.984_127e-4; // 1/7!
    let p = p * x + 1.388_888_9e-3; // 1/6!
    let p = p * x + 8.333_334e-3; // 1/5!
    let p = p * x + 4.166_666_8e-2; // 1/4!
    let p = p * x + 0.166_666_67; // 1/3!
    let p = p * x + 0.5;
    let p = p * x + 1.0;
    let p = p * x + 1.0;
    let n = n as i32; // -150..=127
    let low = n < -126;
    let scale1 = pow2i(if low { n + 64 } else { n });
    let scale2 = if low { pow2i(-64) } else { 1.0 };
    let r = (p * scale1) * scale2;
    if y >= 128.0 {
        f32::INFINITY
    } else if y < -150.0 {
        0.0
    } else {
        r
    }
}

/// `a^p` for `a >= 0`: 0 for `a == 0`, else `exp2_poly(p * log2_poly(a))`.
#[inline(always)]
pub fn pow_p(a: f32, p: f32) -> f32 {
    let r = exp2_poly(p * log2_poly(a));
    if a == 0.0 {
        0.0
    } else {
        r
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    #[test]
    fn accuracy() {
        let mut a = 1e-30f32;
        while a < 1e30 {
            let l = log2_poly(a) as f64;
            assert!(
                (l - (a as f64).log2()).abs() < 2e-6 * (1.0 + (a as f64).log2().abs()),
                "{a}"
            );
            for p in [2.4f32, 1.0, 3.0, 0.5] {
                let want = (a as f64).powf(p as f64);
                if want > 1e-37 && want < 1e37 {
                    let got = pow_p(a, p) as f64;
                    assert!(
                        ((got - want) / want).abs() < 1e-4,
                        "a={a} p={p} {got} {want}"
                    );
                }
            }
            a *= 1.77;
        }
        assert_eq!(pow_p(0.0, 2.4), 0.0);
        assert_eq!(exp2_poly(0.0), 1.0);
        assert_eq!(exp2_poly(10.0), 1024.0);
    }
}
