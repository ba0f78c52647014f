//! The crate's single error type.

use std::path::PathBuf;

use crate::Dtype;

/// Result alias used throughout `forge-io`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while reading or writing a checkpoint.
///
/// Every variant names the file it concerns and, where one is involved, the
/// tensor, together with the expected and actual values.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O call failed (open, mmap, write, fsync, rename,
    /// including `ENOSPC`/`EFBIG` when the disk or the file-size limit is full).
    #[error("{op} {}{}: {source}", path.display(), fmt_tensor(tensor))]
    Io {
        /// What was being done ("open", "write", "fsync", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The tensor being written or read, if any.
        tensor: Option<String>,
        /// The underlying error; `source.kind()` tells `StorageFull` apart.
        source: std::io::Error,
    },
    /// No checkpoint could be located at the given path.
    #[error("no checkpoint at {}: {reason}", path.display())]
    NoCheckpoint {
        /// The path given to [`crate::Checkpoint::open`].
        path: PathBuf,
        /// Why nothing was found.
        reason: String,
    },
    /// The file is shorter than the 8-byte header-length prefix.
    #[error("{}: file is {len} bytes, shorter than the 8-byte header length prefix", file.display())]
    Truncated {
        /// The shard.
        file: PathBuf,
        /// Its actual length.
        len: u64,
    },
    /// The header length prefix is above the accepted cap.
    #[error("{}: header length {header_len} exceeds the cap of {max} bytes", file.display())]
    HeaderTooLarge {
        /// The shard.
        file: PathBuf,
        /// The length read from the prefix.
        header_len: u64,
        /// [`crate::MAX_HEADER_BYTES`].
        max: u64,
    },
    /// The header would extend past the end of the file.
    #[error("{}: header of {header_len} bytes (after the 8-byte prefix) runs past the end of the {file_len}-byte file", file.display())]
    HeaderPastEof {
        /// The shard.
        file: PathBuf,
        /// The length read from the prefix.
        header_len: u64,
        /// The actual file length.
        file_len: u64,
    },
    /// The header is not UTF-8 JSON of the expected shape.
    #[error("{}: invalid header: {reason}", file.display())]
    InvalidHeader {
        /// The shard.
        file: PathBuf,
        /// Parser message.
        reason: String,
    },
    /// One tensor entry of the header is malformed (missing field, wrong type).
    #[error("{}: tensor {tensor:?}: invalid header entry: {reason}", file.display())]
    InvalidEntry {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Parser message.
        reason: String,
    },
    /// The header names a dtype this crate does not know.
    #[error("{}: tensor {tensor:?}: unknown dtype {dtype:?}", file.display())]
    UnknownDtype {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string as written.
        dtype: String,
    },
    /// `data_offsets` are reversed or end past the data area.
    #[error("{}: tensor {tensor:?}: data_offsets [{begin}, {end}] do not fit the data area of {data_len} bytes", file.display())]
    InvalidOffsets {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Start offset (relative to the data area).
        begin: u64,
        /// End offset (exclusive).
        end: u64,
        /// Length of the data area (file length − 8 − header length).
        data_len: u64,
    },
    /// The element count or byte size of a shape overflows.
    #[error("{}: tensor {tensor:?}: size of shape {shape:?} overflows", file.display())]
    SizeOverflow {
        /// The shard (empty for a plan).
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape.
        shape: Vec<u64>,
    },
    /// The byte range does not match `numel × dtype size`.
    #[error("{}: tensor {tensor:?}: {dtype} {shape:?} needs {expected} bytes, data_offsets span {actual}", file.display())]
    SizeMismatch {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: Dtype,
        /// Its shape.
        shape: Vec<usize>,
        /// `numel × dtype size`.
        expected: u64,
        /// `end − begin`.
        actual: u64,
    },
    /// Two tensors of one shard share bytes.
    #[error("{}: tensors {first:?} [{first_begin}, {first_end}) and {second:?} [{second_begin}, ..) overlap", file.display())]
    Overlap {
        /// The shard.
        file: PathBuf,
        /// The earlier tensor.
        first: String,
        /// Its start.
        first_begin: u64,
        /// Its end.
        first_end: u64,
        /// The tensor starting inside the first.
        second: String,
        /// Its start.
        second_begin: u64,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("{}: invalid index: {reason}", file.display())]
    InvalidIndex {
        /// The index file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The index maps a tensor to a shard file that does not exist.
    #[error("{}: tensor {tensor:?} is mapped to missing shard {}", index.display(), shard.display())]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The first tensor mapped to the shard.
        tensor: String,
        /// The missing shard.
        shard: PathBuf,
    },
    /// The index maps a tensor to a shard that does not contain it.
    #[error("{}: tensor {tensor:?} is mapped to {}, which does not contain it", index.display(), shard.display())]
    NotInShard {
        /// The index file.
        index: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shard the index names.
        shard: PathBuf,
    },
    /// A shard holds a tensor the index does not list (or lists under another shard).
    #[error("{}: tensor {tensor:?} is stored in {} but the index does not map it there", index.display(), shard.display())]
    Unindexed {
        /// The index file.
        index: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shard holding it.
        shard: PathBuf,
    },
    /// A tensor name occurs twice (in one header or across shards, or twice in a plan).
    #[error("tensor {tensor:?} appears twice: in {} and in {}", first.display(), second.display())]
    Duplicate {
        /// The tensor.
        tensor: String,
        /// Where it was seen first.
        first: PathBuf,
        /// Where it was seen again (may equal `first`).
        second: PathBuf,
    },
    /// No tensor of that name exists.
    #[error("{}: no tensor {tensor:?}", checkpoint.display())]
    NotFound {
        /// The checkpoint (or output directory, for the writer).
        checkpoint: PathBuf,
        /// The tensor asked for.
        tensor: String,
    },
    /// The operation is not defined for the tensor's dtype.
    #[error("{}: tensor {tensor:?}: {op} is not supported for dtype {dtype}", file.display())]
    UnsupportedDtype {
        /// The shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype.
        dtype: Dtype,
        /// The operation ("to_f32", "fp8 block dequantization").
        op: &'static str,
    },
    /// An FP8 weight and its `weight_scale_inv` do not fit together.
    #[error("{}: FP8 weight {weight:?} with scale {scale:?}: expected {expected}, got {actual}", file.display())]
    Fp8Scale {
        /// The weight's shard.
        file: PathBuf,
        /// The FP8 weight.
        weight: String,
        /// The scale tensor's name.
        scale: String,
        /// What was expected (a shape, derived from the weight's shape).
        expected: String,
        /// What was found.
        actual: String,
    },
    /// A shard plan cannot be built.
    #[error("invalid shard plan: tensor {tensor:?}: {reason}")]
    InvalidPlan {
        /// The offending tensor (empty when the plan as a whole is wrong).
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The bytes handed to the writer have the wrong length.
    #[error("{}: tensor {tensor:?}: plan says {expected} bytes, got {actual}", file.display())]
    WriteLength {
        /// The `.partial` shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// Planned byte count.
        expected: u64,
        /// Bytes given.
        actual: u64,
    },
    /// A tensor was written (or marked written) twice, or is being written concurrently.
    #[error("{}: tensor {tensor:?} was already written", file.display())]
    AlreadyWritten {
        /// The `.partial` shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor can only be marked written if its shard was reopened with its bytes intact.
    #[error("{}: tensor {tensor:?} cannot be marked written: the shard was created fresh, not reopened", file.display())]
    NotReopened {
        /// The `.partial` shard.
        file: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// `finish` was called before every planned tensor was written.
    #[error("{}: {} planned tensors were never written, e.g. {:?} in {}", dir.display(), missing.len(), first_missing(missing).0, first_missing(missing).1)]
    Unwritten {
        /// The output directory.
        dir: PathBuf,
        /// `(tensor, shard file name)` for every missing tensor.
        missing: Vec<(String, String)>,
    },
}

fn fmt_tensor(tensor: &Option<String>) -> String {
    match tensor {
        Some(t) => format!(" (tensor {t:?})"),
        None => String::new(),
    }
}

fn first_missing(missing: &[(String, String)]) -> (&str, &str) {
    missing
        .first()
        .map_or(("", ""), |(t, f)| (t.as_str(), f.as_str()))
}

impl Error {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
        tensor: Option<&str>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        let tensor = tensor.map(str::to_owned);
        move |source| Error::Io {
            op,
            path,
            tensor,
            source,
        }
    }
}
