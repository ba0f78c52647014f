//! The Hessian preparation in Rust (damping, dead inputs, activation order, `U = chol(H⁻¹)`
//! by factorising, inverting and factorising again with faer): the reference the Rust tests
//! prepare the solver's inputs with. The run prepares Hessians with one implementation for
//! both devices, `forge.quant.prepare_hessian_batched` (see docs/numerics.md); this module is
//! built only for tests and with the `reference` feature.

use crate::dtype::check_finite;
use crate::error::{check_len, Error, Result};
use faer::linalg::solvers::DenseSolveCore;
use faer::{Mat, MatRef, Side};
use rayon::prelude::*;

/// Extra damping attempts (×10 each) when the Cholesky factorisation fails.
pub const MAX_DAMP_RETRIES: usize = 6;

/// A prepared Hessian: everything the solver needs.
#[derive(Clone, Debug)]
pub struct HessianFactor {
    /// Upper Cholesky factor `U` of `H⁻¹` (row-major `C × C`, `H⁻¹ = Uᵀ U`), in processing
    /// order (permuted when `perm` is set).
    pub hinv_chol: Vec<f32>,
    /// Processing order (activation order) or `None` for the natural order.
    pub perm: Option<Vec<usize>>,
    /// Damping added to the diagonal (absolute).
    pub damp: f32,
    /// How many times the damping had to be increased.
    pub retries: usize,
    /// Number of dead inputs (zero Hessian diagonal).
    pub dead: usize,
}

/// Prepares `H (C × C)` for GPTQ: dead inputs get a unit diagonal, `percdamp · mean(diag)`
/// is added to the diagonal, optional activation order (descending diagonal, stable),
/// then `U = chol(H⁻¹)` upper. Retries with ×10 damping when a factorisation fails.
pub fn prepare_hessian(
    h: &[f32],
    c: usize,
    percdamp: f32,
    act_order: bool,
) -> Result<HessianFactor> {
    if c == 0 {
        return Err(Error::shape("hessian", "a non-empty square matrix", "0x0"));
    }
    check_len("hessian", h.len(), c, c)?;
    check_finite("hessian", h)?;
    if !(percdamp.is_finite() && percdamp >= 0.0) {
        return Err(Error::param(
            "percdamp",
            "must be a finite number >= 0",
            percdamp,
        ));
    }
    let mut diag: Vec<f32> = (0..c).map(|i| h[i * c + i]).collect();
    if let Some(i) = diag.iter().position(|&d| d < 0.0) {
        return Err(Error::param(
            "hessian",
            format!("diagonal must be >= 0 (a Hessian is X^T X); entry {i} is negative"),
            diag[i],
        ));
    }
    let mut dead = 0;
    for d in diag.iter_mut() {
        if *d == 0.0 {
            *d = 1.0;
            dead += 1;
        }
    }
    let perm = act_order.then(|| {
        let mut p: Vec<usize> = (0..c).collect();
        // original diagonal (dead inputs last), descending, stable
        p.sort_by(|&a, &b| {
            h[b * c + b]
                .partial_cmp(&h[a * c + a])
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        p
    });
    let idx = |i: usize| perm.as_ref().map_or(i, |p| p[i]);
    let mean = diag.iter().map(|&d| d as f64).sum::<f64>() / c as f64;
    let mut damp = (percdamp as f64 * mean) as f32;
    if damp == 0.0 {
        damp = (percdamp as f64 * mean).max(f32::MIN_POSITIVE as f64) as f32;
    }
    let mut retries = 0;
    loop {
        let hd = Mat::<f32>::from_fn(c, c, |i, j| {
            let (a, b) = (idx(i), idx(j));
            if i == j {
                diag[a] + damp
            } else {
                h[a * c + b]
            }
        });
        if let Some(u) = inverse_cholesky_upper(hd.as_ref()) {
            return Ok(HessianFactor {
                hinv_chol: u,
                perm,
                damp,
                retries,
                dead,
            });
        }
        if retries == MAX_DAMP_RETRIES {
            return Err(Error::NotPositiveDefinite { retries, damp });
        }
        retries += 1;
        damp = if damp > 0.0 { damp * 10.0 } else { 1e-6 };
    }
}

/// `U` (row-major) with `H⁻¹ = Uᵀ U`, or `None` if `H` is not numerically positive definite.
fn inverse_cholesky_upper(h: MatRef<'_, f32>) -> Option<Vec<f32>> {
    let c = h.nrows();
    let llt = h.llt(Side::Lower).ok()?;
    let hinv = llt.inverse();
    let llt2 = hinv.llt(Side::Lower).ok()?;
    let l = llt2.L();
    // Row i of U = column i of L (from the diagonal down).
    let mut u = vec![0f32; c * c];
    u.par_chunks_mut(c).enumerate().for_each(|(i, row)| {
        for (j, v) in row.iter_mut().enumerate().skip(i) {
            *v = l[(j, i)];
        }
    });
    if u.iter().any(|v| !v.is_finite()) || (0..c).any(|i| u[i * c + i] <= 0.0) {
        return None;
    }
    Some(u)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hessian_errors() {
        assert!(matches!(
            prepare_hessian(&[f32::NAN], 1, 0.01, false),
            Err(Error::NonFinite { .. })
        ));
        assert!(prepare_hessian(&[1.0, 2.0], 1, 0.01, false).is_err());
        // indefinite: damping retries then success or a clear error
        let h = [1.0f32, 3.0, 3.0, 1.0];
        match prepare_hessian(&h, 2, 0.01, false) {
            Ok(f) => assert!(f.retries > 0),
            Err(e) => assert!(matches!(e, Error::NotPositiveDefinite { .. })),
        }
        let f = prepare_hessian(&[0.0, 0.0, 0.0, 4.0], 2, 0.01, false).unwrap();
        assert_eq!(f.dead, 1);
    }
}
