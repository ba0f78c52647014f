//! The crate's error type: one variant per kind of failure, each naming the
//! file, tensor or option concerned, so the CLI prints it as one line.

use std::path::PathBuf;

/// Result alias used throughout `forge-run`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can stop a run, an inspection or a verification.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a checkpoint failed (bad header, missing shard,
    /// full disk, ...). The inner error names the file and the tensor.
    #[error(transparent)]
    Checkpoint(Box<forge_io::Error>),
    /// The core maths rejected a tensor (NaN weight, scale outside fp16, ...).
    #[error("{}: tensor {tensor:?}: {source}", file.display())]
    Quantize {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// What the core said.
        source: Box<forge_core::Error>,
    },
    /// A non-finite value in a weight that is to be quantized.
    #[error("{}: tensor {tensor:?}: non-finite value {value} at row {row}, column {col}", file.display())]
    NonFinite {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Output channel.
        row: usize,
        /// Input channel.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A linear selected for quantization cannot be packed (`K % G`, `N % 8`).
    #[error("{module}: {reason}")]
    Unpackable {
        /// The module.
        module: String,
        /// What is wrong and how to get around it.
        reason: String,
    },
    /// `config.json` (or another metadata file) is missing or malformed.
    #[error("{}: {reason}", file.display())]
    Config {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An option value is invalid.
    #[error("invalid option {option}: {reason}")]
    Options {
        /// The option (`--group-size`, `max_shard_size`, ...).
        option: String,
        /// Why.
        reason: String,
    },
    /// The output directory cannot be used (not empty, same as the input, ...).
    #[error("output directory {}: {reason}", dir.display())]
    OutDir {
        /// The directory.
        dir: PathBuf,
        /// Why, and which flag would allow it.
        reason: String,
    },
    /// `--resume` found no usable manifest, or one from a different run.
    #[error("cannot resume in {}: {reason}", dir.display())]
    Resume {
        /// The output directory.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// A plain file operation outside the safetensors writer failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The output failed verification.
    #[error("{}: {} problem(s); first: {}", dir.display(), problems.len(), problems.first().map_or("", String::as_str))]
    Verify {
        /// The checked directory.
        dir: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },
    /// The test hook `FORGE_TEST_ABORT_AFTER_LAYERS` stopped the run.
    #[error(
        "aborted by {} after {units} unit(s) (test hook)",
        crate::run::ABORT_ENV
    )]
    TestAbort {
        /// Units finished by this invocation before stopping.
        units: usize,
    },
    /// The test hook `FORGE_TEST_ABORT_AFTER_RENAMES` stopped the publication.
    #[error(
        "aborted by {} after renaming {renamed} shard(s) (test hook)",
        crate::run::ABORT_RENAMES_ENV
    )]
    TestAbortFinish {
        /// Shards renamed into place by this invocation.
        renamed: usize,
    },
    /// The caller asked the run to stop (Ctrl-C from Python).
    #[error("interrupted; rerun with --resume to continue")]
    Interrupted,
    /// A quantizer backend failed in a way of its own.
    #[error("quantizer {quantizer}: {reason}")]
    Quantizer {
        /// The quantizer's name.
        quantizer: String,
        /// What failed.
        reason: String,
    },
}

impl From<forge_io::Error> for Error {
    fn from(e: forge_io::Error) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}

impl Error {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    pub(crate) fn config(file: impl Into<PathBuf>, reason: impl Into<String>) -> Error {
        Error::Config {
            file: file.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn options(option: &str, reason: impl Into<String>) -> Error {
        Error::Options {
            option: option.into(),
            reason: reason.into(),
        }
    }

    /// The underlying OS error, when the failure is an I/O one.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Checkpoint(e) => match e.as_ref() {
                forge_io::Error::Io { source, .. } => Some(source),
                _ => None,
            },
            _ => None,
        }
    }
}
