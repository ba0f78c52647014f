//! CPU maths of 4bit-forge: qmeta4 group metadata, quantization grids (range and
//! MSE/L^p search), the GPTQ solver, int4 packing (vLLM AWQ and GPTQ v1 layouts) and the
//! W4A16 reference matmul. No I/O, no CUDA: this crate is the reference the CUDA kernels
//! in `cuda/` are tested against.
//!
//! Invariants (see `docs/numerics.md` for the exact arithmetic):
//! - A grid is built over the rows of a row-major `[rows, cols]` tensor in groups of
//!   `group_size` consecutive elements (the last group padded with zeros).
//! - Everything is fp32 inside; inputs may be f32, f16, bf16 or fp8 E4M3 ([`Element`]).
//! - No fused multiply-add, round-half-to-even everywhere, fixed reduction orders, so a
//!   GPU implementation can reproduce integer outputs bit for bit.
//! - Every public function validates its arguments and returns [`Error`]; nothing panics
//!   on bad input.
//!
//! Example: quantize a small weight with round-to-nearest on the range grid and pack it
//! for vLLM.
//! ```
//! use forge_core::{grid::{build_range, GridSpec}, pack::quantize_pack_awq};
//! let (n, k) = (8, 64);
//! let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
//! let spec = GridSpec { bits: 4, group_size: 32, symmetric: false };
//! let qmeta = build_range(&w, n, k, &spec).unwrap();
//! let awq = quantize_pack_awq(&w, &qmeta, n, k, &spec).unwrap();
//! assert_eq!(awq.qweight.len(), k * n / 8);
//! ```
#![deny(missing_docs)]

pub mod dtype;
pub mod error;
pub mod gptq;
pub mod grid;
pub mod matmul;
pub mod pack;
pub mod pmath;
pub mod qmeta;

pub use dtype::{Element, F8E4M3};
pub use error::{Error, Result};
pub use grid::{GridSpec, MseSpec};
pub use qmeta::QMeta;
