//! The crate's error type.

/// Everything that can go wrong in the core maths. Variants name the argument and the
/// expected and actual values, so the message reaches the user unchanged.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    /// A tensor has the wrong shape or length.
    #[error("{name}: expected {expected}, got {actual}")]
    Shape {
        /// Argument name.
        name: String,
        /// What was expected.
        expected: String,
        /// What was given.
        actual: String,
    },
    /// A scalar parameter is out of range.
    #[error("{name}: {message} (got {value})")]
    Param {
        /// Parameter name.
        name: String,
        /// What is allowed.
        message: String,
        /// The given value.
        value: String,
    },
    /// NaN or infinity in an input.
    #[error("{name}: non-finite value {value} at index {index}")]
    NonFinite {
        /// Argument name.
        name: String,
        /// Flat index of the first offending element.
        index: usize,
        /// The value.
        value: f32,
    },
    /// The Hessian could not be factorised even with extra damping.
    #[error("hessian: Cholesky failed after {retries} retries (last damping {damp}); the Hessian is not positive definite")]
    NotPositiveDefinite {
        /// Retries made.
        retries: usize,
        /// Last damping tried.
        damp: f32,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn shape(name: &str, expected: impl ToString, actual: impl ToString) -> Self {
        Error::Shape {
            name: name.into(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        }
    }
    pub(crate) fn param(name: &str, message: impl ToString, value: impl ToString) -> Self {
        Error::Param {
            name: name.into(),
            message: message.to_string(),
            value: value.to_string(),
        }
    }
}

/// Checks `len == rows * cols` (with overflow checking).
pub(crate) fn check_len(name: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
    let want = rows.checked_mul(cols).ok_or_else(|| {
        Error::shape(name, "a size that fits in memory", format!("{rows}x{cols}"))
    })?;
    if len != want {
        return Err(Error::shape(
            name,
            format!("{want} elements ({rows}x{cols})"),
            format!("{len} elements"),
        ));
    }
    Ok(())
}
