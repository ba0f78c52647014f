//! Element types and their conversion to `f32`.

use half::{bf16, f16};
use rayon::prelude::*;

/// The safetensors element types this crate reads and writes.
///
/// Sub-byte and FNUZ float8 types are rejected at parse time as unknown.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary64.
    F64,
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// OCP float8 E4M3FN (bias 7, no infinities, `S.1111.111` is NaN).
    F8_E4M3,
    /// OCP float8 E5M2 (the top byte of an IEEE binary16).
    F8_E5M2,
    /// Signed 64-bit integer.
    I64,
    /// Signed 32-bit integer.
    I32,
    /// Signed 16-bit integer.
    I16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 64-bit integer.
    U64,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte per element.
    BOOL,
}

impl Dtype {
    /// Every supported dtype.
    pub const ALL: [Dtype; 15] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U64,
        Dtype::U32,
        Dtype::U16,
        Dtype::U8,
        Dtype::BOOL,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::I8 | Dtype::U8 | Dtype::BOOL => 1,
        }
    }

    /// The name used in safetensors headers (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::I16 => "I16",
            Dtype::I8 => "I8",
            Dtype::U64 => "U64",
            Dtype::U32 => "U32",
            Dtype::U16 => "U16",
            Dtype::U8 => "U8",
            Dtype::BOOL => "BOOL",
        }
    }

    /// Parses a safetensors dtype name; `None` if unknown.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether [`crate::TensorView::to_f32`] can convert this dtype.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F8_E4M3 | Dtype::F8_E5M2
        )
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Exact value of every fp8 E4M3 (`e4m3fn`) byte: the one table of the project, owned by
/// `forge-core` (the CUDA kernels embed the same table).
pub use forge_core::dtype::E4M3_TABLE as E4M3_TO_F32;

/// Decodes one E5M2 byte (exact: E5M2 is the high byte of an IEEE half).
#[inline]
pub fn e5m2_to_f32(b: u8) -> f32 {
    f16::from_bits(u16::from(b) << 8).to_f32()
}

/// Elements per rayon task when converting.
const CHUNK: usize = 1 << 16;

/// Converts little-endian `bytes` of a float dtype into `out`
/// (`out.len() × dtype.size() == bytes.len()`). Returns false for a non-float
/// dtype. Works on unaligned input.
pub(crate) fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> bool {
    fn run<const W: usize>(bytes: &[u8], out: &mut [f32], f: impl Fn([u8; W]) -> f32 + Sync) {
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * W))
            .for_each(|(o, b)| {
                for (o, c) in o.iter_mut().zip(b.chunks_exact(W)) {
                    let mut a = [0u8; W];
                    a.copy_from_slice(c);
                    *o = f(a);
                }
            });
    }
    match dtype {
        Dtype::F32 => run(bytes, out, f32::from_le_bytes),
        Dtype::F64 => run(bytes, out, |a| f64::from_le_bytes(a) as f32),
        Dtype::F16 => run(bytes, out, |a| f16::from_le_bytes(a).to_f32()),
        Dtype::BF16 => run(bytes, out, |a| bf16::from_le_bytes(a).to_f32()),
        Dtype::F8_E4M3 => run(bytes, out, |[a]: [u8; 1]| E4M3_TO_F32[usize::from(a)]),
        Dtype::F8_E5M2 => run(bytes, out, |[a]: [u8; 1]| e5m2_to_f32(a)),
        _ => return false,
    }
    true
}
