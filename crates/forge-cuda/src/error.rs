//! Error type of forge-cuda.

use cudarc::driver::DriverError;

/// Everything that can go wrong in forge-cuda. Nothing in this crate panics on a missing
/// driver, a missing NVRTC, a compile failure or a bad argument: it returns one of these.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (libcuda) could not be loaded or initialised.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// NVRTC (libnvrtc) could not be loaded.
    #[error("NVRTC not available: {0}")]
    NoNvrtc(String),
    /// The requested device ordinal does not exist.
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Number of devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver call {op} failed: {code}")]
    Driver {
        /// The driver function (or the operation) that failed.
        op: &'static str,
        /// The driver's error name and description.
        code: String,
    },
    /// NVRTC rejected a kernel module.
    #[error("NVRTC could not compile module {module}: {log}")]
    Compile {
        /// Module (source file) name.
        module: String,
        /// NVRTC's log.
        log: String,
    },
    /// A kernel entry point was not found in its compiled module.
    #[error("kernel {0} is missing from its module")]
    MissingKernel(String),
    /// An argument does not satisfy the kernel's requirements.
    #[error("invalid argument {name}: expected {expected}, got {actual}")]
    InvalidArgument {
        /// Argument name.
        name: &'static str,
        /// What was expected.
        expected: String,
        /// What was given.
        actual: String,
    },
}

/// Result alias of forge-cuda.
pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    pub(crate) fn driver(op: &'static str, e: DriverError) -> Self {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let desc = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver {
            op,
            code: format!("{:?} {name}: {desc}", e.0),
        }
    }
    pub(crate) fn arg(
        name: &'static str,
        expected: impl Into<String>,
        actual: impl ToString,
    ) -> Self {
        CudaError::InvalidArgument {
            name,
            expected: expected.into(),
            actual: actual.to_string(),
        }
    }
}

/// `.drv("cuXxx")?` on driver results.
pub(crate) trait DrvExt<T> {
    fn drv(self, op: &'static str) -> Result<T>;
}
impl<T> DrvExt<T> for std::result::Result<T, DriverError> {
    fn drv(self, op: &'static str) -> Result<T> {
        self.map_err(|e| CudaError::driver(op, e))
    }
}
