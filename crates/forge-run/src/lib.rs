//! The 4bit-forge quantization run: turns a Hugging Face checkpoint folder of
//! any size into a 4-bit checkpoint that stock vLLM loads (AWQ "gemm", GPTQ v1
//! or compressed-tensors `pack-quantized`, see [`format`]),
//! streaming one decoder layer at a time. It owns the orchestration, not the
//! maths (`forge-core`) or the file formats (`forge-io`).
//!
//! - [`arch`]: model families as data (linears, routers, fused groups,
//!   default exclusions, expert naming); unknown models fall back to a
//!   Llama-like description.
//! - [`plan`]: every tensor's fate and the exact output tensor set, decided
//!   and validated (shapes, group divisibility) before anything is written.
//! - [`quantizer`]: the [`LinearQuantizer`] seam (a whole layer at a time) and
//!   the data-free [`RtnQuantizer`] (range or MSE grid).
//! - [`run`]: the orchestrator: planned shards written at their offsets as
//!   results arrive, a manifest of finished units for `--resume` (byte-identical
//!   to an uninterrupted run), `config.json` and the index written last.
//! - [`format`]: the output format (tensors of a quantized linear, packing,
//!   `quantization_config`, what verify expects).
//! - [`verify`], [`inspect`]: checks and summaries of checkpoint folders.
//! - [`lock`]: the exclusive lock on an output directory.
//! - [`cli`]: the `forge-rs` command line, also reached from Python.
//!
//! Invariants: memory is bounded by the linears being quantized at once (a
//! layer's weights are read from the mmap, never copied whole); output bytes
//! depend only on the source and the [`plan::QuantOptions`], never on thread
//! count or timing. Internal API of 4bit-forge.
#![deny(missing_docs)]

pub mod arch;
pub mod cli;
mod error;
pub mod format;
pub mod inspect;
pub mod lock;
pub mod options;
pub mod plan;
pub mod prune;
pub mod quantizer;
pub mod run;
pub mod session;
pub mod verify;

pub use error::{Error, Result};
pub use format::OutputFormat;
pub use plan::QuantOptions;
pub mod cuda_quantizer;
pub use cuda_quantizer::CudaRtnQuantizer;
pub use options::Options;
pub use quantizer::{LayerJob, LinearJob, LinearQuantizer, RtnQuantizer, Sink};
pub use run::{quantize, quantize_with, NoProgress, Progress, RunReport};
pub use session::{Session, UnitSync};
