//! CUDA kernels of 4bit-forge — qmeta4 grids, fused AWQ quantize+pack, int4 packing,
//! W4A16 GEMM on the vLLM AWQ layout, Hessian accumulation and the blocked GPTQ solver —
//! compiled at run time with NVRTC and launched through cudarc's driver layer. It does no
//! I/O and holds no model logic; `forge-core` is the CPU reference every kernel matches.
//!
//! Invariants:
//! - Sources live in the top-level `cuda/` folder (`common.cuh` + one `.cu` per family) and
//!   are embedded with `include_str!`; forge-core's qmeta and fp8 tables are emitted as a
//!   generated header so both sides use identical constants. Compiled with `--fmad=false`
//!   for the exact arch (`sm_90a` on Hopper) to a CUBIN, cached on disk under
//!   `$XDG_CACHE_HOME/4bit-forge/kernels` (or `~/.cache/...`, or `$FORGE_KERNEL_CACHE`).
//! - Integer outputs (qmeta, codes, packed words) are bit-identical to forge-core; GEMM,
//!   Hessian and GPTQ float results match to a stated tolerance (see the tests).
//! - The launch functions in [`ops`] take raw device pointers (u64) and a raw `CUstream`
//!   (u64, 0 = legacy default stream): what PyTorch's `data_ptr()` and
//!   `current_stream().cuda_stream` give. They bind the device's primary context (the one
//!   PyTorch uses) on the calling thread before every launch.
//! - Nothing panics without a driver: [`status`] reports, every call returns [`CudaError`].
//!
//! Example (needs a GPU):
//! ```no_run
//! use forge_cuda::{status, DeviceBuf, ops::{self, DType, Stream}};
//! use forge_core::grid::GridSpec;
//! if status().available {
//!     let (rows, cols) = (16, 256);
//!     let x = DeviceBuf::from_slice(0, &vec![0.5f32; rows * cols]).unwrap();
//!     let q = DeviceBuf::zeroed(0, rows * cols / 128 * 4).unwrap();
//!     let spec = GridSpec { bits: 4, group_size: 128, symmetric: false };
//!     let grid = ops::QmetaGrid { x: x.ptr(), dtype: DType::F32, rows, cols, spec, qmeta: q.ptr(), block_scale: 0 };
//!     unsafe { ops::qmeta_range(&grid, Stream::default()) }.unwrap();
//!     let qmeta: Vec<u32> = q.download().unwrap();
//! }
//! ```
//!
//! The API is used by forge-py and forge-cli; it is not meant for end users.

mod buf;
mod error;
pub mod kernels;
pub mod ops;
mod runtime;

pub use buf::{copy_d2d, synchronize, time_ms, DeviceBuf};
pub use error::{CudaError, Result};
pub use ops::{DType, Stream};
pub use runtime::{compile_for_arch, nvrtc_options, nvrtc_version, status, CudaStatus};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn status_never_panics() {
        let st = status();
        if !st.available {
            assert!(st.reason.is_some());
        }
    }

    #[test]
    fn no_driver_path_returns_err() {
        if status().available {
            return;
        }
        assert!(DeviceBuf::zeroed(0, 16).is_err());
        assert!(ops::compile_all(0).is_err());
        let spec = forge_core::grid::GridSpec {
            bits: 4,
            group_size: 128,
            symmetric: false,
        };
        let grid = ops::QmetaGrid {
            x: 256,
            dtype: DType::F32,
            rows: 1,
            cols: 128,
            spec,
            qmeta: 256,
            block_scale: 0,
        };
        let r = unsafe { ops::qmeta_range(&grid, Stream::default()) };
        assert!(r.is_err());
    }

    /// Compiles every module for sm_90a and sm_80 with NVRTC alone (no GPU needed); skipped when
    /// NVRTC cannot be loaded.
    #[test]
    fn sources_compile_with_nvrtc() {
        if nvrtc_version().is_err() {
            eprintln!("skipping: no NVRTC");
            return;
        }
        // Hopper, and an older target where the wgmma kernels compile to empty bodies.
        for arch in ["sm_90a", "sm_80"] {
            for m in kernels::Module::ALL {
                let cubin = compile_for_arch(m, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
                assert!(cubin.len() > 1000, "{arch} {}", m.name());
                // Every entry point the kernel table names is in the CUBIN (its symbol table
                // holds the names): a module that compiles but lost a kernel fails here, not
                // at its first launch on a GPU.
                for k in m.kernels() {
                    let found = cubin
                        .windows(k.len() + 1)
                        .any(|w| &w[..k.len()] == k.as_bytes() && w[k.len()] == 0);
                    assert!(found, "{arch} {}: no entry point {k}", m.name());
                }
            }
        }
    }
}
