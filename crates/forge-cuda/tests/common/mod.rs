#![allow(dead_code)]
//! Helpers shared by the GPU integration tests.

use forge_cuda::status;

/// True when a GPU can run the kernels; prints why not otherwise (the test then returns).
pub fn gpu() -> bool {
    let st = status();
    if !st.available {
        eprintln!("skipping GPU test: {}", st.reason.unwrap_or_default());
    }
    st.available
}

/// Deterministic pseudo-random numbers (no dependency on rand's API).
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u32() as f32 / 2147483648.0) - 1.0
    }
    /// Roughly normal (sum of 4 uniforms).
    pub fn n(&mut self) -> f32 {
        (self.f() + self.f() + self.f() + self.f()) * 0.866
    }
    pub fn below(&mut self, n: u32) -> u32 {
        self.next_u32() % n
    }
}

pub fn u32s_of<T: Copy>(v: &[T]) -> Vec<u32> {
    assert_eq!(std::mem::size_of::<T>(), 4);
    // SAFETY: T is 4 bytes of plain data in every caller.
    v.iter()
        .map(|x| unsafe { std::mem::transmute_copy::<T, u32>(x) })
        .collect()
}
