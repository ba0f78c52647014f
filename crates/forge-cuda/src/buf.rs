//! A small safe device buffer for the native-binary path and tests, plus synchronisation
//! and event timing helpers.

use crate::error::{CudaError, DrvExt, Result};
use crate::runtime::{device, Device};
use cudarc::driver::{result as dr, sys};

/// Device memory owned by Rust (allocated with `cuMemAlloc`, freed on drop). Copies are
/// synchronous (they wait for the work on the legacy default stream).
pub struct DeviceBuf {
    dev: &'static Device,
    ptr: u64,
    bytes: usize,
}

impl std::fmt::Debug for DeviceBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuf {{ device: {}, ptr: {:#x}, bytes: {} }}",
            self.dev.ordinal, self.ptr, self.bytes
        )
    }
}

impl DeviceBuf {
    /// Allocates `bytes` (at least 1) of zeroed device memory on `device`.
    pub fn zeroed(device_ordinal: usize, bytes: usize) -> Result<Self> {
        let dev = device(device_ordinal)?;
        dev.bind()?;
        let n = bytes.max(1);
        // SAFETY: plain allocation in the bound context, then zero-filled.
        let ptr = unsafe { dr::malloc_sync(n) }.drv("cuMemAlloc")?;
        let buf = DeviceBuf { dev, ptr, bytes };
        // SAFETY: ptr holds n bytes.
        unsafe { dr::memset_d8_sync(ptr, 0, n) }.drv("cuMemsetD8")?;
        Ok(buf)
    }

    /// Allocates and uploads `data`.
    pub fn from_slice<T: Copy>(device_ordinal: usize, data: &[T]) -> Result<Self> {
        let mut b = Self::zeroed(device_ordinal, std::mem::size_of_val(data))?;
        b.upload(data)?;
        Ok(b)
    }

    /// Overwrites the start of the buffer with `data`.
    pub fn upload<T: Copy>(&mut self, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        if n > self.bytes {
            return Err(CudaError::arg(
                "data",
                format!("at most {} bytes", self.bytes),
                n,
            ));
        }
        if n == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the destination holds at least n bytes; T: Copy has no drop glue.
        unsafe { dr::memcpy_htod_sync(self.ptr, data) }.drv("cuMemcpyHtoD")
    }

    /// Downloads the whole buffer as `bytes / size_of::<T>()` elements of `T`.
    ///
    /// `T` must be a plain-old-data type for which every bit pattern is valid (integers,
    /// floats, `half::f16`, ...).
    pub fn download<T: Copy + Default>(&self) -> Result<Vec<T>> {
        let sz = std::mem::size_of::<T>().max(1);
        let mut v = vec![T::default(); self.bytes / sz];
        if v.is_empty() {
            return Ok(v);
        }
        self.dev.bind()?;
        // SAFETY: v holds at most self.bytes bytes; T is plain data (documented).
        unsafe { dr::memcpy_dtoh_sync(&mut v, self.ptr) }.drv("cuMemcpyDtoH")?;
        Ok(v)
    }

    /// Raw device pointer (for the `unsafe` launch functions).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: ptr was allocated by cuMemAlloc in this context and is freed once.
            let _ = unsafe { dr::free_sync(self.ptr) };
        }
    }
}

/// Waits for all work on `device` (binding its context on this thread first).
pub fn synchronize(device_ordinal: usize) -> Result<()> {
    let dev = device(device_ordinal)?;
    dev.bind()?;
    dr::ctx::synchronize().drv("cuCtxSynchronize")
}

/// Mean milliseconds per call of `f` on `stream`, measured with CUDA events over `iters`
/// calls after `warmup` untimed ones.
pub fn time_ms(
    device_ordinal: usize,
    stream: u64,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f32> {
    let dev = device(device_ordinal)?;
    dev.bind()?;
    for _ in 0..warmup {
        f()?;
    }
    let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
    let a = dr::event::create(flags).drv("cuEventCreate")?;
    let b = dr::event::create(flags).drv("cuEventCreate")?;
    let s = stream as sys::CUstream;
    let res = (|| {
        // SAFETY: events just created, stream given by the caller.
        unsafe { dr::event::record(a, s) }.drv("cuEventRecord")?;
        for _ in 0..iters.max(1) {
            f()?;
        }
        unsafe { dr::event::record(b, s) }.drv("cuEventRecord")?;
        unsafe { dr::event::synchronize(b) }.drv("cuEventSynchronize")?;
        let ms = unsafe { dr::event::elapsed(a, b) }.drv("cuEventElapsedTime")?;
        Ok(ms / iters.max(1) as f32)
    })();
    // SAFETY: both events are ours and no longer used.
    unsafe {
        let _ = dr::event::destroy(a);
        let _ = dr::event::destroy(b);
    }
    res
}

/// Device-to-device copy of `bytes` ordered on `stream` (also the bandwidth yardstick of
/// the benchmarks).
///
/// # Safety
/// `dst` and `src` must be device allocations of `device` holding `bytes` bytes each and
/// must not overlap.
pub unsafe fn copy_d2d(
    device_ordinal: usize,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: u64,
) -> Result<()> {
    let dev = device(device_ordinal)?;
    dev.bind()?;
    // SAFETY: upheld by the caller.
    unsafe { dr::memcpy_dtod_async(dst, src, bytes, stream as sys::CUstream) }
        .drv("cuMemcpyDtoDAsync")
}
