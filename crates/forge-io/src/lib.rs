//! Streaming safetensors checkpoint I/O for 4bit-forge: validated, zero-copy
//! reading of (sharded) Hugging Face checkpoints, FP8 block dequantization,
//! decoder-layer grouping, and a planned multi-shard writer. It does no
//! quantization maths and no CUDA; `forge-core` does those.
//!
//! # Reading
//! [`Checkpoint::open`] maps every shard read-only (memmap2) and validates each
//! header before any tensor is handed out:
//! - the file holds an 8-byte little-endian header length `n`, `n ≤`
//!   [`MAX_HEADER_BYTES`], and `8 + n ≤` file length;
//! - the header is UTF-8 JSON, one object; `__metadata__` maps strings to
//!   strings; no key appears twice;
//! - every dtype is a known [`Dtype`]; `begin ≤ end ≤` data-area length;
//!   `end − begin == numel × size` (checked multiplication);
//! - no two non-empty byte ranges overlap (gaps are tolerated);
//! - with `model.safetensors.index.json`, the index and the shards agree
//!   exactly: every mapped file exists and holds the tensor, every stored
//!   tensor is mapped to its shard, and no name is stored twice.
//!
//! A [`TensorView`] is then a plain `&[u8]` slice of the mmap (little-endian,
//! not necessarily aligned). Iteration is in storage order: shards by file
//! name, then by data offset, so a sequential pass streams from disk.
//!
//! # Writing
//! A [`ShardPlan`] fixes every tensor's shard and offset before any byte is
//! written (output shapes are known before quantizing). [`ShardWriter`] writes
//! each header into `<file>.partial`, sets the final length, and accepts
//! tensors in any order from any thread (`pwrite` at the planned offset).
//! [`ShardWriter::finish`] fsyncs and renames the shards into place and
//! writes the index atomically. A shard under its final name is therefore
//! always complete; an interrupted run leaves only `.partial` files.
//! Within a shard, tensors are laid out by descending element size, so every
//! tensor is aligned to its dtype; the files load with the `safetensors` crate.
//!
//! ```no_run
//! use forge_io::{Checkpoint, Dtype, ShardPlan, ShardWriter, TensorSpec, DEFAULT_MAX_SHARD_BYTES};
//! # fn main() -> forge_io::Result<()> {
//! let ckpt = Checkpoint::open("/models/DeepSeek-V3")?;
//! for layer in ckpt.layers() {
//!     for name in ckpt.layer_tensors(layer) {
//!         let w = ckpt.dequantized_f32(name)?; // FP8 × weight_scale_inv, or plain
//!         # let _ = w;
//!     }
//! }
//! let plan = ShardPlan::new([TensorSpec::new("x", Dtype::F32, [2])], DEFAULT_MAX_SHARD_BYTES)?;
//! let writer = ShardWriter::create("/out", plan, &Default::default())?;
//! writer.write_tensor("x", &[0u8; 8])?;
//! writer.finish()?;
//! # Ok(()) }
//! ```
//!
//! The API is internal to 4bit-forge and may change between versions.
#![deny(missing_docs)]

mod checkpoint;
mod dtype;
mod error;
mod header;
mod writer;

pub use checkpoint::{split_layer_name, Checkpoint, TensorView, FP8_BLOCK};
pub use dtype::{e5m2_to_f32, Dtype, E4M3_TO_F32};
pub use error::{Error, Result};
pub use writer::{
    PlannedShard, PlannedTensor, ShardPlan, ShardWriter, TensorSpec, DEFAULT_MAX_SHARD_BYTES,
    PARTIAL_SUFFIX,
};

/// Largest accepted header (the JSON after the length prefix), in bytes.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// File name of the Hugging Face shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
