//! Portable `log2`, `exp2` and `pow` written with plain f32 `+ − *`, fused multiply-adds
//! (`mul_add`; `fmaf` in CUDA) and bit manipulation only, so that `cuda/common.cuh` (compiled
//! with `--fmad=false`: only its explicit `fmaf` fuse) computes bit-identical values. There is
//! no division and no float ↔ int conversion: on a GPU each of those issues at 1/8 of the FMA
//! rate, and `pow_p` runs once per element and candidate of the MSE grid search. Integers are
//! moved in and out of floats with the `1.5 · 2^23` trick instead. Relative accuracy of
//! `pow_p` ≈ 3e-7, ample for a loss in a grid search. Keep the operation sequence in sync with
//! the CUDA mirror.

/// `1.5 · 2^23`: for |y| < 2^22, `y + ROUND` holds `round_ties_even(y)` in its low mantissa
/// bits (its bits are `ROUND_BITS + n`), and `(y + ROUND) − ROUND` is that integer as f32.
const ROUND: f32 = 12_582_912.0;
const ROUND_BITS: u32 = 0x4B40_0000;

/// The integer `k` (|k| < 2^22) as f32, exactly, from its bits.
#[inline(always)]
fn int_f32(k: i32) -> f32 {
    f32::from_bits(ROUND_BITS.wrapping_add(k as u32)) - ROUND
}

/// log2 of a positive finite `a` (0 gives ≈ −150.5; callers select 0 for it). Written with
/// selects instead of branches so that it vectorises.
#[inline(always)]
pub fn log2_poly(a: f32) -> f32 {
    let sub = a < f32::MIN_POSITIVE;
    let a2 = if sub { a * 8_388_608.0 } else { a };
    // a2 = 2^k · m with m in [√½, √2) (musl's reduction: offset the bits by 1 − √½).
    let ix = a2.to_bits().wrapping_add(0x3F80_0000 - 0x3F35_04F3);
    let m = f32::from_bits((ix & 0x007F_FFFF) + 0x3F35_04F3);
    let k = (ix >> 23) as i32 - if sub { 127 + 23 } else { 127 };
    // t = (m − 1) / (m + 1), |t| ≤ 0.1716: a linear seed of 1/d on [1 + √½, 1 + √2), one
    // Newton step (relative error 2e-4), then one correction of the quotient (≈ 5e-8).
    let f = m - 1.0;
    let d = m + 1.0;
    let r = (-0.239_013_31f32).mul_add(d, 0.985_055_86);
    let r = r.mul_add((-d).mul_add(r, 1.0), r);
    let t = f * r;
    let t = r.mul_add((-t).mul_add(d, f), t);
    // log2(m) = (2 / ln 2) · atanh(t) = t · s(t²), s a minimax quadratic (relative 1.5e-7).
    let t2 = t * t;
    let s = 0.595_772_74f32
        .mul_add(t2, 0.961_588_6)
        .mul_add(t2, 2.885_390_5);
    t.mul_add(s, int_f32(k))
}

/// 2^y for finite `y`: `y` is clamped to [−127, 127], so results below ≈ 2^-126.5 are 0 and
/// `y` ≥ 127 gives 2^127 (as a loss term it only has to be huge).
#[inline(always)]
// approx_constant: q's minimax coefficient 0.6931471 is one ulp below ln 2 on purpose;
// manual_clamp: max/min, not clamp, so that a NaN gives −127 as fmaxf/fminf do in CUDA.
#[allow(clippy::approx_constant, clippy::manual_clamp)]
pub fn exp2_poly(y: f32) -> f32 {
    let yc = y.max(-127.0).min(127.0);
    let v = yc + ROUND;
    let f = yc - (v - ROUND); // |f| <= 0.5, exact
                              // 2^f = 1 + f · q(f), q a minimax quartic (relative 1.7e-7), exact 1 at f = 0.
    let q = 1.333_352_4e-3f32
        .mul_add(f, 9.666_245e-3)
        .mul_add(f, 5.550_500_4e-2)
        .mul_add(f, 0.240_223_51)
        .mul_add(f, 0.693_147_1);
    let p = f.mul_add(q, 1.0);
    // 2^n from n's bits in v: n + 127 is the biased exponent (n = −127 gives 0.0).
    let scale = f32::from_bits(v.to_bits().wrapping_sub(ROUND_BITS).wrapping_add(127) << 23);
    p * scale
}

/// `a^p` for `a >= 0`, `p > 0`: 0 for `a == 0`, else `exp2_poly(p * log2_poly(a))`.
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
        // Normal and subnormal inputs, log2 and pow against f64. The pow bound is the
        // polynomials' ~3e-7 plus what rounding log2(a) and y = p · log2(a) to f32 costs in
        // 2^y (≈ |y| · 2^-24 · ln 2 each, p · log2(a) rounding first).
        let mut a = f32::from_bits(1);
        let (mut worst_log, mut worst_pow) = (0f64, 0f64);
        while a < 1e30 {
            let want_l = (a as f64).log2();
            let l = log2_poly(a) as f64;
            let err_l = (l - want_l).abs() / (1.0 + want_l.abs());
            assert!(err_l < 2e-7, "log2({a}) = {l}, want {want_l}");
            worst_log = worst_log.max(err_l);
            for p in [2.4f32, 1.0, 3.0, 0.5] {
                let want = (a as f64).powf(p as f64);
                if want > 1e-37 && want < 1e37 {
                    let got = pow_p(a, p) as f64;
                    let err = ((got - want) / want).abs();
                    let y = (p as f64 * want_l).abs();
                    assert!(err < 5e-7 + y * 1.2e-7, "a={a} p={p} {got} {want}");
                    worst_pow = worst_pow.max(err / (5e-7 + y * 1.2e-7));
                }
            }
            // (a subnormal times 1.0137 can round back to itself)
            a = (a * 1.0137).max(f32::from_bits(a.to_bits() + 1));
        }
        assert!(worst_log > 0.0 && worst_pow > 0.0);
        assert_eq!(pow_p(0.0, 2.4), 0.0);
        assert_eq!(pow_p(0.0, 0.5), 0.0);
        for n in -126..=127 {
            assert_eq!(exp2_poly(n as f32), (n as f64).exp2() as f32, "2^{n}");
        }
        // Below 2^-126.5 and at NaN: 0; from 127: 2^127.
        assert_eq!(exp2_poly(-126.6), 0.0);
        assert_eq!(exp2_poly(-1000.0), 0.0);
        assert_eq!(exp2_poly(f32::NAN), 0.0);
        assert_eq!(exp2_poly(500.0), 2f32.powi(127));
    }

    #[test]
    fn integers_cross_through_bits_exactly() {
        for k in [-150, -127, -1, 0, 1, 128, (1 << 22) - 1, -(1 << 22) + 1] {
            assert_eq!(int_f32(k), k as f32);
        }
    }
}
