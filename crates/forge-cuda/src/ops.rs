//! Launch functions on raw device pointers and a caller-provided stream.
//!
//! Every function validates shapes and divisibility, then launches asynchronously on
//! `stream` (a raw `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`; 0 = the
//! legacy default stream) of `device`, after binding that device's primary context on the
//! calling thread. Pointers are device addresses (`tensor.data_ptr()`), row-major and
//! contiguous, with the dtypes documented per function.
//!
//! Launches of many arguments take them as a typed struct ([`QmetaGrid`], [`QuantizePack`]
//! or [`PackCodes`] with the [`PackedOut`] buffers, [`W4a16Gemm`], [`GroupedGemv`]) whose
//! field docs give each pointer's layout and whose `validate()` checks sizes, divisibility
//! and alignment, naming the argument at fault, before the driver is touched. A linear is
//! `n` out features × `k` in features throughout.
//!
//! # Safety (all functions)
//! Every pointer must point to device memory of `device` that holds at least the documented
//! number of elements, stays alive until the work on `stream` has finished, and is not
//! written concurrently by other work. Output buffers must not alias inputs unless stated.

use crate::error::{CudaError, DrvExt, Result};
use crate::runtime::{device, launch, launch_clustered, launch_programmatic, Device, Func};
use cudarc::driver::{result as dr, sys};
use forge_core::grid::{GridSpec, MseSpec};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Where to launch: a device ordinal and a raw `CUstream` handle (0 = legacy default stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stream {
    /// Device ordinal.
    pub device: usize,
    /// Raw `CUstream` (0 = legacy default stream).
    pub handle: u64,
}

impl Stream {
    /// The legacy default stream of `device`.
    pub fn default_of(device: usize) -> Self {
        Stream { device, handle: 0 }
    }
}

/// Element type of an input tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// float32
    F32,
    /// float16
    F16,
    /// bfloat16
    Bf16,
    /// float8 E4M3 (raw bytes)
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F8E4M3 => 1,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8E4M3 => "f8e4m3",
        }
    }
}

macro_rules! args {
    ($($a:ident),* $(,)?) => {
        [$( (&mut $a) as *mut _ as *mut c_void ),*]
    };
}

fn kname(prefix: &str, dt: DType) -> Result<&'static str> {
    let full = format!("{prefix}_{}", dt.suffix());
    crate::kernels::all_kernels()
        .find(|k| *k == full)
        .ok_or(CudaError::arg(
            "dtype",
            format!("a dtype supported by {prefix}"),
            format!("{dt:?}"),
        ))
}

fn to_i32(name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::arg(name, "a value below 2^31", v))
}

fn check_spec(spec: &GridSpec) -> Result<()> {
    spec.validate()
        .map_err(|e| CudaError::arg("spec", "a valid GridSpec", e))
}

fn check_nonzero(name: &'static str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(CudaError::arg(name, "a positive size", v));
    }
    Ok(())
}

/// `v` in `1..=most`.
fn check_count(name: &'static str, v: usize, most: usize) -> Result<()> {
    if v == 0 || v > most {
        return Err(CudaError::arg(name, format!("1..={most}"), v));
    }
    Ok(())
}

/// A router's top-k ids: int64 (8-byte aligned) or int32 (4-byte aligned).
fn check_ids(ptr: u64, ids_i64: bool) -> Result<()> {
    check_align("ids", ptr, if ids_i64 { 8 } else { 4 })
}

fn check_align(name: &'static str, ptr: u64, align: u64) -> Result<()> {
    if ptr == 0 || !ptr.is_multiple_of(align) {
        return Err(CudaError::arg(
            name,
            format!("a non-null device pointer aligned to {align} bytes"),
            format!("{ptr:#x}"),
        ));
    }
    Ok(())
}

fn blocks(n: usize, per: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per)).map_err(|_| CudaError::arg("grid", "fewer than 2^32 blocks", n))
}

fn dev_of(s: Stream) -> Result<&'static Device> {
    device(s.device)
}

// ---------------------------------------------------------------------------------------
// (a) qmeta grids

/// Side of DeepSeek's FP8 weight blocks. An F8_E4M3 weight `[R, C]` with block scales
/// (`weight_scale_inv`, f32 `[ceil(R/128), ceil(C/128)]`, row-major, 4-byte aligned) is read
/// by the grid and fused pack launches as `e4m3(x[r, c]) · scale[r/128, c/128]`, one f32
/// multiply, exactly as `forge_io::Checkpoint::dequantized_f32` computes it: the FP8 bytes
/// go to the GPU as they are stored, never widened to f32 on the host. (`cuda/common.cuh`
/// has the same value as `FORGE_FP8_BLOCK`; a test ties the two.)
pub use forge_core::dtype::FP8_BLOCK;

fn check_block_scale(ptr: u64, dtype: DType) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    if dtype != DType::F8E4M3 {
        return Err(CudaError::arg(
            "block_scale",
            "0 unless the weight is F8_E4M3",
            format!("{dtype:?}"),
        ));
    }
    check_align("block_scale", ptr, 4)
}

/// Arguments of [`qmeta_range`] and [`qmeta_mse`]: the qmeta4 grid of a matrix, one group
/// of `spec.group_size` columns at a time (for a weight: `rows` = `n` out features, `cols`
/// = `k` in features).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmetaGrid {
    /// The matrix `[rows, cols]` of `dtype`, row-major, aligned to its element size. Finite
    /// values (not checked here).
    pub x: u64,
    /// Element type of `x`.
    pub dtype: DType,
    /// Rows of `x` (out features of a weight): positive.
    pub rows: usize,
    /// Columns of `x` (in features of a weight): positive; the last group is zero-padded
    /// when `cols % G != 0`.
    pub cols: usize,
    /// The grid's spec.
    pub spec: GridSpec,
    /// u32 `[rows, ceil(cols/G)]` qmeta4 words, 4-byte aligned: written by [`qmeta_range`],
    /// refined in place by [`qmeta_mse`].
    pub qmeta: u64,
    /// FP8 block scales (see [`FP8_BLOCK`]) or 0 for none.
    pub block_scale: u64,
}

impl QmetaGrid {
    /// Checks spec, sizes and pointers without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_spec(&self.spec)?;
        check_nonzero("rows", self.rows)?;
        check_nonzero("cols", self.cols)?;
        to_i32("rows", self.rows)?;
        to_i32("cols", self.cols)?;
        self.groups()?;
        check_align("x", self.x, self.dtype.size() as u64)?;
        check_align("qmeta", self.qmeta, 4)?;
        check_block_scale(self.block_scale, self.dtype)?;
        Ok(())
    }

    /// Groups in the whole matrix (`rows · ceil(cols/G)`).
    fn groups(&self) -> Result<usize> {
        self.rows
            .checked_mul(self.spec.groups(self.cols))
            .ok_or(CudaError::arg("rows", "rows·groups < 2^63", self.rows))
    }
}

/// The range grid's kernel (cuda/grid.cu), for `a` on a device of compute capability `cc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RangeKernel {
    /// `qmeta_range_oct_<dt>`: every group whole and 128 or 256 bytes long (with block scales
    /// 128: one 128-column block), read by octets of lanes so that a warp's load covers whole
    /// lines of 4 groups.
    Octets,
    /// `qmeta_range_tpg_<dt>`: one thread a group, its whole 16-byte units.
    PerGroup,
    /// `qmeta_range_<dt>`: one lane per 8 elements of a group (any shape).
    Lanes,
}

/// Octets or one thread a group need every group in whole 16-byte units (x 16-byte aligned,
/// the group size and the columns multiples of 16 bytes' worth of elements) and, for E4M3,
/// the hardware's pairwise conversion (sm_89+).
fn range_kernel(a: &QmetaGrid, cc: (i32, i32)) -> RangeKernel {
    let per_unit = 16 / a.dtype.size();
    let g = a.spec.group_size;
    let units = a.x.is_multiple_of(16)
        && a.cols.is_multiple_of(per_unit)
        && g.is_multiple_of(per_unit)
        && (a.dtype != DType::F8E4M3 || cc >= (8, 9));
    let gbytes = g * a.dtype.size();
    if !units {
        RangeKernel::Lanes
    } else if a.cols.is_multiple_of(g) && (gbytes == 128 || (gbytes == 256 && a.block_scale == 0)) {
        RangeKernel::Octets
    } else {
        RangeKernel::PerGroup
    }
}

/// Range grid (spec §6.2) of `a.x` into `a.qmeta` (see [`QmetaGrid`]). Bit-identical to
/// `forge_core::grid::build_range`. Every argument is checked by [`QmetaGrid::validate`]
/// before the driver is touched.
///
/// # Safety
/// See the module documentation.
pub unsafe fn qmeta_range(a: &QmetaGrid, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    // Threads per group: one (a warp's 32 groups read together by octets of lanes, or each
    // group by its thread), or grid.cu's range_lanes: one lane per 8 elements of a group, a
    // power of two, at most 32.
    let (name, lanes) = match range_kernel(a, dev.cc) {
        RangeKernel::Octets => ("qmeta_range_oct", 1),
        RangeKernel::PerGroup => ("qmeta_range_tpg", 1),
        RangeKernel::Lanes => (
            "qmeta_range",
            a.spec.group_size.div_ceil(8).next_power_of_two().min(32),
        ),
    };
    let f = dev.function(kname(name, a.dtype)?)?;
    let grid = blocks(a.groups()? * lanes, 256)?;
    let (mut px, mut pq) = (a.x, a.qmeta);
    let (mut r, mut c, mut g) = (
        to_i32("rows", a.rows)?,
        to_i32("cols", a.cols)?,
        to_i32("group_size", a.spec.group_size)?,
    );
    let (mut bits, mut sym) = (a.spec.bits as i32, a.spec.symmetric as i32);
    let (mut bs, mut bcols) = (a.block_scale, to_i32("cols", a.cols.div_ceil(FP8_BLOCK))?);
    let mut p = args!(px, pq, r, c, g, bits, sym, bs, bcols);
    // SAFETY: parameter list matches qmeta_range_<dt>; pointers per the caller's contract.
    unsafe { launch(dev, f, (grid, 1, 1), (256, 1, 1), 0, s.handle, &mut p) }
}

/// MSE / L^p refinement (spec §6.3) of `a.qmeta` in place (see [`QmetaGrid`]).
/// Bit-identical to `forge_core::grid::refine_mse`. The kernel computes the candidate
/// shrink factors from `max_shrink` and `n_grid` exactly as `MseSpec::candidates` does: no
/// table shared between launches, so concurrent calls on different streams with different
/// grids are safe. Every argument is checked before the driver is touched.
///
/// # Safety
/// See the module documentation.
pub unsafe fn qmeta_mse(a: &QmetaGrid, mse: &MseSpec, s: Stream) -> Result<()> {
    a.validate()?;
    mse.validate()
        .map_err(|e| CudaError::arg("mse", "a valid MseSpec", e))?;
    let n_grid = to_i32("n_grid", mse.n_grid)?;
    let dev = dev_of(s)?;
    let f = dev.function(kname("qmeta_mse", a.dtype)?)?;
    let grid = blocks(a.groups()? * 32, 128)?;
    let smem = (4 * a.spec.group_size * 4) as u32;
    let (mut px, mut pq) = (a.x, a.qmeta);
    let (mut r, mut c, mut g) = (
        to_i32("rows", a.rows)?,
        to_i32("cols", a.cols)?,
        to_i32("group_size", a.spec.group_size)?,
    );
    let (mut bits, mut ng, mut norm, mut shrink) =
        (a.spec.bits as i32, n_grid, mse.norm, mse.max_shrink);
    let (mut bs, mut bcols) = (a.block_scale, to_i32("cols", a.cols.div_ceil(FP8_BLOCK))?);
    let mut p = args!(px, pq, r, c, g, bits, ng, norm, shrink, bs, bcols);
    // SAFETY: parameter list matches qmeta_mse_<dt>.
    unsafe { launch(dev, f, (grid, 1, 1), (128, 1, 1), smem, s.handle, &mut p) }
}

// ---------------------------------------------------------------------------------------
// (b) packing

/// Shape and grid checks shared by the pack launches: `forge_core::pack::check_pack_shape`
/// (a linear of `n` out features × `k` in features with `n % 8 == 0`, `k % G == 0`, 4-bit
/// codes), its failure named as the launch argument at fault, and sizes that fit an i32.
fn check_pack_shape(n: usize, k: usize, spec: &GridSpec) -> Result<()> {
    forge_core::pack::check_pack_shape(k, n, spec).map_err(|e| {
        let arg = match &e {
            forge_core::Error::Shape { name, .. } if name == "out_features" => "n",
            forge_core::Error::Shape { name, .. } if name == "in_features" => "k",
            _ => "spec",
        };
        CudaError::arg(
            arg,
            "a packable linear (n % 8 == 0, k % group_size == 0, 4 bits)",
            e,
        )
    })?;
    to_i32("n", n)?;
    to_i32("k", k)?;
    Ok(())
}

/// The three packed int4 tensors a pack launch writes ([`awq_quantize_pack`],
/// [`awq_pack_codes`], [`gptq_pack_codes`]) for a linear of `N` out features × `K` in
/// features with group size `G`. All row-major and contiguous; none may alias the inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedOut {
    /// i32, `K·N/8` words, 4-byte aligned. AWQ: `[K, N/8]`, nibble `i` of word `[k, c]` is
    /// column `8c + ORDER[i]`, `ORDER = {0,2,4,6,1,3,5,7}`. GPTQ v1: `[K/8, N]`, nibble `i`
    /// of word `[r, n]` is row `8r + i`.
    pub qweight: u64,
    /// i32 `[K/G, N/8]`, 4-byte aligned: zero points, 8 per word. AWQ: in `ORDER`. GPTQ v1:
    /// `z − 1` in plain order.
    pub qzeros: u64,
    /// f16 `[K/G, N]`, 2-byte aligned: group scales.
    pub scales: u64,
}

impl PackedOut {
    /// Checks the pointers (non-null, aligned for the kernels' stores) without touching the
    /// driver.
    pub fn validate(&self) -> Result<()> {
        check_align("qweight", self.qweight, 4)?;
        check_align("qzeros", self.qzeros, 4)?;
        check_align("scales", self.scales, 2)?;
        Ok(())
    }
}

/// Input of [`awq_quantize_pack`]: a weight and its qmeta grid, round-to-nearest quantized
/// and packed in one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantizePack {
    /// The weight `[N, K]` of `dtype`, row-major (the checkpoint's `weight`: one row per out
    /// feature), 16-byte aligned (32 for F32).
    pub w: u64,
    /// Element type of `w`.
    pub dtype: DType,
    /// Out features (rows of `w`): a positive multiple of 8.
    pub n: usize,
    /// In features (columns of `w`): a positive multiple of `spec.group_size`.
    pub k: usize,
    /// u32 `[N, K/G]` qmeta4 grid of `w` (as [`qmeta_range`] writes it), 4-byte aligned.
    pub qmeta: u64,
    /// The grid's spec: 4 bits, group size `G`.
    pub spec: GridSpec,
    /// FP8 block scales of `w` (see [`FP8_BLOCK`]) or 0 for none.
    pub block_scale: u64,
}

impl QuantizePack {
    /// Checks shape, spec and pointers (together with `out`, by [`awq_quantize_pack`])
    /// without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_pack_shape(self.n, self.k, &self.spec)?;
        check_align("w", self.w, if self.dtype == DType::F32 { 32 } else { 16 })?;
        check_align("qmeta", self.qmeta, 4)?;
        check_block_scale(self.block_scale, self.dtype)?;
        Ok(())
    }
}

/// Input of [`awq_pack_codes`] and [`gptq_pack_codes`]: integer codes (the GPTQ solver's
/// output) and their qmeta grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackCodes {
    /// u8 codes `[K, N]`, row-major (`weight_t` layout, the GPTQ solver's output), each
    /// `<= 15`. Non-null; [`awq_pack_codes`] also needs it 8-byte aligned (it reads 8 codes
    /// at once).
    pub codes: u64,
    /// u32 `[N, K/G]` qmeta4 grid (one row per out feature), 4-byte aligned.
    pub qmeta: u64,
    /// Out features (columns of `codes`): a positive multiple of 8.
    pub n: usize,
    /// In features (rows of `codes`): a positive multiple of `spec.group_size`.
    pub k: usize,
    /// The grid's spec: 4 bits, group size `G`.
    pub spec: GridSpec,
}

impl PackCodes {
    /// Checks shape, spec and pointers without touching the driver (the 8-byte alignment
    /// of `codes` that only [`awq_pack_codes`] needs is checked there).
    pub fn validate(&self) -> Result<()> {
        check_pack_shape(self.n, self.k, &self.spec)?;
        check_align("codes", self.codes, 1)?;
        check_align("qmeta", self.qmeta, 4)?;
        Ok(())
    }
}

/// Fused round-to-nearest quantize + AWQ pack of `a.w [N, K]` on its grid into the AWQ
/// layout of `out` (see [`QuantizePack`] and [`PackedOut`]). Bit-identical to
/// `forge_core::pack::quantize_pack_awq`. Every argument is checked before the driver is
/// touched; besides [`QuantizePack::validate`] and [`PackedOut::validate`], `out.qweight`
/// must be 8-byte aligned.
///
/// # Safety
/// See the module documentation.
pub unsafe fn awq_quantize_pack(a: &QuantizePack, out: &PackedOut, s: Stream) -> Result<()> {
    a.validate()?;
    out.validate()?;
    check_align("qweight", out.qweight, 8)?;
    let (n, k, spec) = (a.n, a.k, &a.spec);
    let dev = dev_of(s)?;
    let f = dev.function(kname("awq_quant_pack", a.dtype)?)?;
    let (mut pw, mut pm) = (a.w, a.qmeta);
    let (mut pqw, mut pqz, mut psc) = (out.qweight, out.qzeros, out.scales);
    let (mut nn, mut kk, mut g, mut bits) = (
        to_i32("n", n)?,
        to_i32("k", k)?,
        spec.group_size as i32,
        spec.bits as i32,
    );
    let (mut bs, mut bcols) = (a.block_scale, to_i32("k", k.div_ceil(FP8_BLOCK))?);
    let mut p = args!(pw, pm, pqw, pqz, psc, nn, kk, g, bits, bs, bcols);
    let (tile_n, tile_k) = pack_tile(a.dtype);
    let grid = (blocks(k, tile_k)?, blocks(n, tile_n)?, 1);
    let block = (PACK_THREADS, 1, 1);
    // SAFETY: parameter list matches awq_quant_pack_<dt>; its tile takes `pack_smem` bytes.
    unsafe { launch(dev, f, grid, block, pack_smem(a.dtype), s.handle, &mut p) }
}

/// Threads a block of `awq_quant_pack_<dt>`: a lane quantizes 8 rows × 8 inputs (pack.cu
/// `PACK_THREADS`, from the generated header).
pub(crate) const PACK_THREADS: u32 = 256;

/// The tile of a block of `awq_quant_pack_<dt>`, (rows, inputs): pack.cu `QP_BN` × `QP_BK`
/// (256 × 64), and for FP8 `QP8_BN` × `QP8_BK` (64 × 256: a row's tile bytes two 128-byte lines,
/// and with G = 128 its two grid words one sector); the generated header defines those four.
pub(crate) const fn pack_tile(dt: DType) -> (usize, usize) {
    match dt {
        DType::F8E4M3 => (64, 256),
        _ => (256, 64),
    }
}

/// Dynamic shared memory of `awq_quant_pack_<dt>`: its block's tile (16, 32 or 64 KB).
pub(crate) const fn pack_smem(dt: DType) -> u32 {
    let (tn, tk) = pack_tile(dt);
    (tn * tk * dt.size()) as u32
}

/// Packs `a.codes [K, N]` with their grid into the AWQ layout of `out` (see [`PackCodes`]
/// and [`PackedOut`]). Bit-identical to `forge_core::pack::pack_awq` for codes ≤ 15. Every
/// argument is checked before the driver is touched; besides [`PackCodes::validate`] and
/// [`PackedOut::validate`], `a.codes` must be 8-byte aligned.
///
/// # Safety
/// See the module documentation.
pub unsafe fn awq_pack_codes(a: &PackCodes, out: &PackedOut, s: Stream) -> Result<()> {
    a.validate()?;
    out.validate()?;
    check_align("codes", a.codes, 8)?;
    let (n, k, spec) = (a.n, a.k, &a.spec);
    let dev = dev_of(s)?;
    let f1 = dev.function("awq_pack_codes")?;
    let f2 = dev.function("awq_pack_meta")?;
    let (mut pc, mut pqw, mut kk, mut nn) =
        (a.codes, out.qweight, to_i32("k", k)?, to_i32("n", n)?);
    let mut p = args!(pc, pqw, kk, nn);
    // SAFETY: parameter lists match awq_pack_codes / awq_pack_meta.
    unsafe {
        launch(
            dev,
            f1,
            (blocks(k * n / 8, 256)?, 1, 1),
            (256, 1, 1),
            0,
            s.handle,
            &mut p,
        )?
    };
    let ngroups = k / spec.group_size;
    let (mut pm, mut pqz, mut psc, mut n2, mut ng, mut bits) = (
        a.qmeta,
        out.qzeros,
        out.scales,
        to_i32("n", n)?,
        ngroups as i32,
        spec.bits as i32,
    );
    let mut p = args!(pm, pqz, psc, n2, ng, bits);
    unsafe {
        launch(
            dev,
            f2,
            (blocks(ngroups * n / 8, 256)?, 1, 1),
            (256, 1, 1),
            0,
            s.handle,
            &mut p,
        )
    }
}

/// Packs `a.codes [K, N]` with their grid into the GPTQ v1 layout of `out` (see
/// [`PackCodes`] and [`PackedOut`]). A zero point of 0 cannot be stored in v1: when
/// `bad_flag` (a device u32, 4-byte aligned, or 0 for none) is given, the kernel sets it to
/// 1 in that case (the CPU `pack_gptq` returns an error). `g_idx` is `k / G` and is left to
/// the caller. Every argument is checked before the driver is touched.
///
/// # Safety
/// See the module documentation.
pub unsafe fn gptq_pack_codes(
    a: &PackCodes,
    out: &PackedOut,
    bad_flag: u64,
    s: Stream,
) -> Result<()> {
    a.validate()?;
    out.validate()?;
    if bad_flag != 0 {
        check_align("bad_flag", bad_flag, 4)?;
    }
    let (n, k, spec) = (a.n, a.k, &a.spec);
    let dev = dev_of(s)?;
    let f1 = dev.function("gptq_pack_codes")?;
    let f2 = dev.function("gptq_pack_meta")?;
    let (mut pc, mut pqw, mut kk, mut nn) =
        (a.codes, out.qweight, to_i32("k", k)?, to_i32("n", n)?);
    let mut p = args!(pc, pqw, kk, nn);
    // SAFETY: parameter lists match gptq_pack_codes / gptq_pack_meta.
    unsafe {
        launch(
            dev,
            f1,
            (blocks(k / 8 * n, 256)?, 1, 1),
            (256, 1, 1),
            0,
            s.handle,
            &mut p,
        )?
    };
    let ngroups = k / spec.group_size;
    let (mut pm, mut pqz, mut psc, mut pb, mut n2, mut ng, mut bits) = (
        a.qmeta,
        out.qzeros,
        out.scales,
        bad_flag,
        to_i32("n", n)?,
        ngroups as i32,
        spec.bits as i32,
    );
    let mut p = args!(pm, pqz, psc, pb, n2, ng, bits);
    unsafe {
        launch(
            dev,
            f2,
            (blocks(ngroups * n / 8, 256)?, 1, 1),
            (256, 1, 1),
            0,
            s.handle,
            &mut p,
        )
    }
}

// ---------------------------------------------------------------------------------------
// (c) W4A16 GEMM

/// Outputs a block, K a stage and threads a block of the mma.sync kernel (cuda/gemm.cu
/// `GM_BW` word columns, `GM_BK`).
const GEMM_BN: usize = 256;
const GEMM_BK: usize = 32;
const GEMM_THREADS: usize = 128;
/// Largest shared-memory slice of x the GEMV path stages per block (bytes).
const GEMV_SMEM: usize = 48 * 1024;

/// Whether an M <= GEMV3_MAX_M product runs the SIMT GEMV (version 3: zero point folded out of
/// the inner loop) rather than the tensor-core GEMV (version 1: weights prefetched into
/// registers, three batches in flight). Version 3 is the default for M = 1 and N >= 8192,
/// where it was measured faster — 36 vs 42–46 µs at K=7168 N=18432 — while it lost at M=4 and
/// on N=2048; `FORGE_GEMV=1|3` forces one.
fn simt_gemv(m: usize, n: usize) -> bool {
    match knobs().gemv {
        Some(1) => false,
        Some(3) => true,
        _ => m == 1 && n >= 8192,
    }
}

/// Tuning knobs from the environment, read once per process (never per launch):
/// `FORGE_GEMV=1|3`, `FORGE_GEMM_MT=1|2|4`, `FORGE_GEMM_WG=0` (the Hopper wgmma kernels
/// off: the GEMVs to M = 16, the mma.sync kernel above, and the grouped form's mma.sync
/// kernel), `FORGE_GEMM_WG_SPLITS=1..8` (its K splits), `FORGE_GEMM_WG_CLUSTER=0|1` (its
/// splits summed through a split-K workspace and a second kernel, or in a thread block cluster
/// whenever the device can launch one),
/// `FORGE_GEMM_WG_TOKENS=16|32|64|128|256` (its tokens a block) and `FORGE_TILED_WARPS=4..32`
/// (the tiled GEMV's warps a block; the M > 8 kernel takes at most 16).
#[derive(Clone, Copy, Debug, Default)]
struct Knobs {
    gemv: Option<usize>,
    gemm_mt: Option<usize>,
    /// `FORGE_GEMM_WG=0`: the wgmma kernels (plain and grouped) never run.
    wgmma_off: bool,
    gemm_wg_splits: Option<usize>,
    gemm_wg_cluster: Option<usize>,
    gemm_wg_tokens: Option<usize>,
    tiled_warps: Option<usize>,
}

fn knobs() -> Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    *KNOBS.get_or_init(|| {
        let read = |name: &str, ok: &[usize]| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|v| ok.contains(v))
        };
        Knobs {
            gemv: read("FORGE_GEMV", &[1, 3]),
            gemm_mt: read("FORGE_GEMM_MT", &[1, 2, 4]),
            wgmma_off: read("FORGE_GEMM_WG", &[0]).is_some(),
            gemm_wg_splits: read("FORGE_GEMM_WG_SPLITS", &[1, 2, 3, 4, 5, 6, 7, 8]),
            gemm_wg_cluster: read("FORGE_GEMM_WG_CLUSTER", &[0, 1]),
            gemm_wg_tokens: read("FORGE_GEMM_WG_TOKENS", &WG_TILES.map(|(t, _)| t)),
            tiled_warps: read(
                "FORGE_TILED_WARPS",
                &(4..=TILED_MAX_WARPS).collect::<Vec<_>>(),
            ),
        }
    })
}

/// Largest M the SIMT GEMV (version 3) handles.
const GEMV3_MAX_M: usize = 4;
/// Warps per block of the version-3 GEMV (each takes a contiguous K slice).
const GEMV3_WARPS: usize = 8;

/// Word columns per lane of the version-3 GEMV kernel for `m` rows (and its row template).
fn gemv3_shape(m: usize) -> (usize, usize) {
    match m {
        1 => (1, 2),
        2 => (2, 2),
        _ => (4, 1),
    }
}

/// Which W4A16 kernel a plan launches (cuda/gemm.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmKernel {
    /// `w4a16_gemv_<dt>`: tensor-core GEMV (M <= 16, power-of-two G).
    Gemv,
    /// `w4a16_gemv3_<dt>_r<rows>`: SIMT GEMV (M <= 4) for `rows` rows.
    Gemv3 { rows: usize },
    /// `w4a16_awq_<dt>_m<mt>`: mma.sync tiles of `mt` m16 tiles per block.
    Tiled { mt: usize },
    /// `w4a16_wg_<dt>_t<tokens>`: Hopper wgmma, `tokens` (one of [`WG_TILES`]) a block.
    Wgmma { tokens: usize },
}

impl GemmKernel {
    /// The GEMVs take log2 of the group size, the others the group size.
    fn takes_log2_group(self) -> bool {
        matches!(self, GemmKernel::Gemv | GemmKernel::Gemv3 { .. })
    }
    /// Launched programmatically (Hopper): the wgmma kernel's set-up overlaps the previous
    /// kernel's tail; it calls `pdl_wait` before it touches memory. (The decode GEMV measured
    /// slower so after a torch kernel: crates/forge-cuda/LOG.md, "Programmatic launch".)
    fn programmatic(self) -> bool {
        matches!(self, GemmKernel::Wgmma { .. })
    }
}

/// How the GEMM splits its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GemmPlan {
    kernel: GemmKernel,
    /// Blocks along N.
    nblocks: usize,
    /// Blocks along M.
    mblocks: usize,
    /// K splits (blockIdx.z).
    splits: usize,
    /// The splits are one thread block cluster (wgmma kernel): summed through distributed
    /// shared memory, no workspace, no reduction kernel.
    cluster: bool,
    /// K per split (multiple of 32).
    k_chunk: usize,
    /// Dynamic shared memory (GEMV and wgmma kernels).
    smem: usize,
    /// Threads per block.
    threads: usize,
    /// Outputs (columns of N) per block.
    block_n: usize,
}

impl GemmPlan {
    /// Splits whose fp32 partials go through the workspace and the reduction kernel (1: none).
    fn workspace_splits(&self) -> usize {
        if self.cluster {
            1
        } else {
            self.splits
        }
    }
}

/// Number of K splits in `lo..=hi` whose grid (`base · s` equal blocks) best fills whole
/// waves of `slots` resident blocks: the smallest `s` with at least one full wave and a
/// last wave at least 85 % full, else the best-filled one.
fn pick_splits(base: usize, slots: usize, lo: usize, hi: usize) -> usize {
    let slots = slots.max(1);
    let hi = hi.max(lo);
    let eff = |s: usize| {
        let b = (base * s) as f64 / slots as f64;
        b / b.ceil()
    };
    (lo..=hi)
        .find(|&s| base * s >= slots && eff(s) >= 0.85)
        .unwrap_or_else(|| {
            (lo..=hi).fold(
                lo,
                |best, s| if eff(s) > eff(best) + 1e-9 { s } else { best },
            )
        })
}

/// K splits and K per split (a multiple of 8 rows per warp) of a version-3 GEMV grid of
/// `base` blocks per split: the split count that best fills waves of `slots` blocks.
fn gemv3_splits(base: usize, slots: usize, k: usize) -> (usize, usize) {
    let unit = 8 * GEMV3_WARPS;
    let units = k.div_ceil(unit);
    let splits = pick_splits(base, slots, 1, units.max(1));
    let per = units.div_ceil(splits).max(1);
    (units.div_ceil(per), per * unit)
}

/// Smallest M the Hopper wgmma kernel takes (smaller M runs the SIMT GEMV). At M = 5 … 16 its
/// 16-token tile beat the tensor-core GEMV on the DeepSeek-V3 shapes on an H100 (LOG.md,
/// "A 16-token tile"): M = 16 7.5 against 12.7 µs at 2048×7168, 47.9 against 62.7 at
/// 7168×18432; M = 5 at 7168×18432 the one row within 1 % of it (45.2 against 44.6).
const WG_MIN_M: usize = GEMV3_MAX_M + 1;
/// Outputs per block and K per stage of the wgmma kernel (cuda/gemm.cu `WG_BK`; 16 word
/// columns a block).
const WG_BN: usize = 128;
const WG_BK: usize = 64;
/// The wgmma kernel's token tiles (`w4a16_wg_<dt>_t<tokens>`: its MMAs are m64n<tokens>k16),
/// largest first, each with the time of its stage against a 128-token one ([`wg_stage_us`]).
/// 256 tokens: 1.4, from an H200 (LOG.md, "A 256-token tile"): at M = 1024-4096 on four
/// DeepSeek-V3 shapes its blocks, one an SM, took 1.14-1.30x less time than 128-token blocks two
/// an SM on 11 of 12 rows, and with 1.4 the plan's estimated ratios came within 13 % of the
/// measured ones on 23 of 24 rows at M = 256 … 4096.
/// Whole-call times on an H100 at M = 32 and the same grid (7168×2048 at 8 splits, 16384×7168
/// at 7; for 64 tokens also 7168×18432 at 7) put 32 tokens at 0.74–0.84 and 64 at 0.80–0.88;
/// 16 tokens took 0.91–0.92 of 32's whole-call time at M = 16 and the same grids on the four
/// DeepSeek-V3 shapes of LOG.md "A 16-token tile" (there, 0.65–0.78 gives every one the same
/// split count).
const WG_TILES: [(usize, f64); 5] = [(256, 1.4), (128, 1.0), (64, 0.84), (32, 0.78), (16, 0.71)];
/// Threads per block of the wgmma kernel: two warpgroups (cuda/gemm.cu `WG_THREADS`).
const WG_THREADS: usize = 256;
/// Most K splits of the wgmma kernel (bounds its fp32 workspace to 8·M·N floats).
pub(crate) const WG_MAX_SPLITS: usize = 8;
/// The wgmma kernel's `split_out` (emitted into the kernels' generated header as `WG_OUT_*`):
/// the outputs in y (K not split), this split's fp32 partials in the split-K workspace, or the
/// splits of a cluster summed in its shared memory and written to y.
pub(crate) const WG_OUT_Y: i32 = 0;
pub(crate) const WG_OUT_PARTIALS: i32 = 1;
pub(crate) const WG_OUT_CLUSTER: i32 = 2;

/// Dynamic shared memory of `w4a16_wg_<dt>_t128`: 4 stages of a 128 × 64 x tile (16 KB), a
/// 64 × 20-word weight tile and 80 words of group metadata, plus 1 KB to start the x tiles on
/// a 1024-byte boundary (where the 128-byte swizzle repeats). The epilogue's 128 × 132 fp32
/// tile reuses the first 67.6 KB. The smaller token tiles use less of the same amount, so that
/// every tile runs two blocks an SM (their registers would allow no more than three).
pub(crate) const W4A16_WG_SMEM: u32 = 1024 + 4 * (128 * 64 * 2 + 64 * 20 * 4 + 80 * 4);
/// Shared memory of an sm_90 SM (H100, H200), of which each resident block also takes 1 KB.
const SM90_SMEM_PER_SM: u32 = 228 * 1024;
/// The same kernel's dynamic shared memory when its grid fits on the SMs at one block each:
/// half an SM's, which with the block's reserved 1 KB leaves no room for a second block, so
/// that no SM takes two blocks while others idle. On an H100, 2048×7168 at M = 256 (112
/// blocks) took 32 µs two blocks an SM and 20.5 alone (LOG.md, "What bounds the M = 128
/// kernel, and one block an SM").
pub(crate) const W4A16_WG_SMEM_ALONE: u32 = SM90_SMEM_PER_SM / 2;
/// Dynamic shared memory of `w4a16_wg_<dt>_t256`: 4 stages of a 256 × 64 x tile (32 KB) and the
/// same weight and metadata stages, plus the 1 KB of alignment; the epilogue's 256 × 132 fp32
/// tile reuses the first 132 KB. One block an SM (its 128 accumulators a thread allow no more).
pub(crate) const W4A16_WG256_SMEM: u32 = 1024 + 4 * (256 * 64 * 2 + 64 * 20 * 4 + 80 * 4);

/// Dynamic shared memory of the wgmma kernels' `tokens` tile (`w4a16_wg_<dt>_t<tokens>`,
/// `w4a16_wgg_<dt>_t<tokens>`), which sets the blocks an SM holds ([`wg_blocks_per_sm`]).
pub(crate) fn wg_tile_smem(tokens: usize) -> u32 {
    if tokens > WG_BN {
        W4A16_WG256_SMEM
    } else {
        W4A16_WG_SMEM
    }
}

/// Blocks of the wgmma kernels' `tokens` tile an sm_90 SM holds at most, by their shared
/// memory: two up to 128 tokens, one for 256.
fn wg_blocks_per_sm(tokens: usize) -> usize {
    (SM90_SMEM_PER_SM / (wg_tile_smem(tokens) + 1024)) as usize
}

/// The wgmma kernel's dynamic shared memory for a grid of `blocks` of `tokens` on `sms` SMs: at
/// least half an SM's when the grid fits them at one block each (alone on its SM), else its
/// tile's ([`wg_tile_smem`]).
fn wg_smem(blocks: usize, sms: usize, tokens: usize) -> u32 {
    let tile = wg_tile_smem(tokens);
    if blocks <= sms {
        tile.max(W4A16_WG_SMEM_ALONE)
    } else {
        tile
    }
}

/// µs a stage of a wgmma GEMM grid of `blocks` on `sms` SMs, `per_sm` of them at most on an SM
/// ([`wg_blocks_per_sm`]), measured on an H100
/// (`FORGE_GEMM_WG_SPLITS`, 2026-11-26): a block alone on its SM takes ≈ 0.58 µs a stage; two
/// blocks sharing an SM (88 KB each) ≈ 0.96 µs a stage for both. A grid of more blocks than SMs
/// pays whole waves of two blocks an SM, its last wave at the alone rate when that wave holds no
/// more blocks than SMs (7168×18432 at M = 192, 288 blocks: 2 · 0.96 predicted against 1.57 µs
/// measured a stage; the per-SM count it replaced said 1.44). Blocks one an SM (the 256-token
/// tile) pay whole waves at the alone rate (their stage cost, [`WG_TILES`], applied by the
/// caller).
fn wg_stage_us(blocks: usize, sms: usize, per_sm: usize) -> f64 {
    let sms = sms.max(1);
    if blocks <= sms {
        return 0.58;
    }
    if per_sm < 2 {
        return 0.58 * blocks.div_ceil(sms) as f64;
    }
    let slots = 2 * sms;
    let (full, rem) = (blocks / slots, blocks % slots);
    let last = match rem {
        0 => 0.0,
        r if r <= sms => 0.58,
        _ => 0.96,
    };
    0.96 * full as f64 + last
}

/// The wgmma kernel's candidate token tiles for M, each with its stage cost ([`WG_TILES`]): up
/// to M = 128 the smallest that holds M in one block; past it 128 and 256, between which the
/// plan takes the one it prices lower ([`wg_splits`]; ties to 128). A smaller tile's MMAs are
/// narrower, but every block dequantizes its weights again, and the dequantization, not the
/// MMAs, holds most of a stage: on an H100 (LOG.md, "Token tiles of 32 and 64"), with M in one
/// block, 32- and 64-token tiles ran 1.1–1.4× faster than 128 at M = 32 and 1.1–1.3× at
/// M = 48 / 64, while two 64-token blocks instead of one of 128 ran 0.65–0.82× at M = 96 / 128;
/// a 256-token block dequantizes once for twice the MMAs of a 128-token one (LOG.md, "A
/// 256-token tile"). `forced` (a tile of [`WG_TILES`]) is the one candidate.
fn wg_tiles(m: usize, forced: Option<usize>) -> Vec<(usize, f64)> {
    let tile = |t: usize| WG_TILES.into_iter().find(|&(u, _)| u == t);
    match forced {
        Some(f) => tile(f).into_iter().collect(),
        None if m > WG_BN => [128, 256].into_iter().filter_map(tile).collect(),
        None => WG_TILES
            .into_iter()
            .rev()
            .find(|&(t, _)| t >= m)
            .into_iter()
            .collect(),
    }
}

/// K splits of the wgmma kernel for `base` blocks per split on `sms` SMs, `stages` 64-deep
/// stages and `outputs` = M·N: the split count with the least estimated time, and that time
/// (µs), `clustered(s)` saying whether `s` splits would be summed in a thread block cluster.
/// The loop by [`wg_stage_us`]; a split through the workspace adds its fp32 partials written and read back
/// (≈ 3 TB/s) and the reduction's launch (≈ 2 µs), one summed in a cluster the partials' trip
/// through distributed shared memory at the same rate and ≈ 2 µs of barriers. On eight
/// DeepSeek-V3 shapes at M = 64 … 512 (H100, LOG.md "The split count against every forced
/// split") it keeps the per-SM model's pick on 42 of 48 rows, is 3–13 % faster on five
/// (7168×18432 at M = 256: 179 → 157 µs) and 4–6 % slower on one (7168×18432 at M = 64, where
/// it prices 3 and 4 splits 0.2 µs apart). Stages cost `stage_cost` times a 128-token stage
/// ([`WG_TILES`]) of `tokens`.
fn wg_splits(
    base: usize,
    sms: usize,
    stages: usize,
    outputs: usize,
    (tokens, stage_cost): (usize, f64),
    clustered: &dyn Fn(usize) -> bool,
) -> (usize, f64) {
    let per_sm = wg_blocks_per_sm(tokens);
    let cost = |s: usize| {
        let mut us = stages.div_ceil(s) as f64 * wg_stage_us(base * s, sms, per_sm) * stage_cost;
        if s > 1 {
            let passes = if clustered(s) { 2 * s } else { 2 * s + 1 };
            us += (passes * outputs * 4) as f64 / 3.0e6 + 2.0;
        }
        us
    };
    // Each count's cost once (`clustered` may ask the driver); ties to the fewer splits.
    (1..=WG_MAX_SPLITS.min(stages.max(1)))
        .map(|s| (s, cost(s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((1, f64::INFINITY))
}

/// Whether the wgmma kernel takes this shape (N a multiple of its 128 outputs a block, K and
/// the group size multiples of its 64-deep stages).
fn wg_shape_ok(n: usize, k: usize, group_size: usize) -> bool {
    n.is_multiple_of(WG_BN) && k.is_multiple_of(WG_BK) && group_size.is_multiple_of(WG_BK)
}

/// What the Hopper wgmma kernel's plan needs of the device: its SM count, and whether a grid
/// of (N blocks, M blocks, K splits) would sum its splits in thread block clusters.
#[derive(Clone, Copy)]
struct WgDevice<'a> {
    sms: usize,
    /// Whether (token tile, N blocks, M blocks, K splits) would be clustered.
    clustered: &'a dyn Fn((usize, usize, usize, usize)) -> bool,
}

impl WgDevice<'static> {
    /// A device whose wgmma splits always go through the workspace (a plan without the
    /// driver's cluster occupancy: the probe plan, and the tests).
    fn without_clusters(sms: usize) -> Self {
        WgDevice {
            sms,
            clustered: &|_| false,
        }
    }
}

/// `slots` = resident blocks per SM × SMs (one full wave). `wg`: when the device and shape allow
/// the Hopper wgmma kernel.
fn gemm_plan(
    slots: usize,
    m: usize,
    n: usize,
    k: usize,
    gemv_ok: bool,
    wg: Option<WgDevice>,
) -> GemmPlan {
    let tiles = k / GEMM_BK;
    if let Some(wg) = wg.filter(|_| m >= WG_MIN_M && !knobs().wgmma_off) {
        let wg_sms = wg.sms;
        let nblocks = n / WG_BN;
        let stages = k / WG_BK;
        // Whether `s` splits of the `tokens` tile are summed in a cluster (one has nothing to sum).
        let clustered = |tokens: usize, s: usize| {
            s > 1 && (wg.clustered)((tokens, nblocks, m.div_ceil(tokens), s))
        };
        // Each candidate tile priced at its best split count; ties to the first (the smaller).
        let (tokens, splits, _) = wg_tiles(m, knobs().gemm_wg_tokens)
            .into_iter()
            .map(|(tokens, stage_cost)| {
                let (splits, us) = wg_splits(
                    nblocks * m.div_ceil(tokens),
                    wg_sms,
                    stages,
                    m * n,
                    (tokens, stage_cost),
                    &|s| clustered(tokens, s),
                );
                (tokens, splits, us)
            })
            .min_by(|a, b| a.2.total_cmp(&b.2))
            .unwrap_or((WG_BN, 1, f64::INFINITY));
        let mblocks = m.div_ceil(tokens);
        let splits = knobs().gemm_wg_splits.unwrap_or(splits).min(stages.max(1));
        let per = stages.div_ceil(splits).max(1);
        let splits = stages.div_ceil(per);
        return GemmPlan {
            kernel: GemmKernel::Wgmma { tokens },
            nblocks,
            mblocks,
            splits,
            cluster: clustered(tokens, splits),
            k_chunk: per * WG_BK,
            smem: wg_smem(nblocks * mblocks * splits, wg_sms, tokens) as usize,
            threads: WG_THREADS,
            block_n: WG_BN,
        };
    }
    if m <= GEMV3_MAX_M && gemv_ok && simt_gemv(m, n) {
        let (rows, wpl) = gemv3_shape(m);
        let block_n = 8 * 32 * wpl;
        let nblocks = n.div_ceil(block_n);
        let (splits, k_chunk) = gemv3_splits(nblocks, slots, k);
        return GemmPlan {
            kernel: GemmKernel::Gemv3 { rows },
            nblocks,
            mblocks: 1,
            splits,
            cluster: false,
            k_chunk,
            smem: 0,
            threads: 32 * GEMV3_WARPS,
            block_n,
        };
    }
    if m <= 16 && gemv_ok {
        let nblocks = (n / 8).div_ceil(8);
        // Largest K slice that fits the shared-memory budget, in units of 32.
        let kmax = ((GEMV_SMEM / (2 * (m + 1))).saturating_sub(8) / GEMM_BK).max(4);
        let lo = tiles.div_ceil(kmax).max(1);
        // Every warp of a block gets at least two batches of 32.
        let hi = (tiles / 8).max(lo);
        let splits = pick_splits(nblocks, slots, lo, hi);
        let per = tiles.div_ceil(splits).max(1);
        let splits = tiles.div_ceil(per);
        let k_chunk = per * GEMM_BK;
        let xbytes = (2 * (m + 1) * (k_chunk + 8)).div_ceil(16) * 16;
        let smem = xbytes.max(3 * 32 * 32 * 4);
        return GemmPlan {
            kernel: GemmKernel::Gemv,
            nblocks,
            mblocks: 1,
            splits,
            cluster: false,
            k_chunk,
            smem,
            threads: 128,
            block_n: 64,
        };
    }
    // FORGE_GEMM_MT=1|2|4 forces the m16 tiles per block of the tiled path (tuning aid).
    let forced = knobs().gemm_mt;
    // Large M: 4 m16 tiles per block, unless that leaves the chip mostly idle (few N blocks).
    let mt = if let Some(f) = forced {
        f
    } else if m <= 16 {
        1
    } else if m <= 32 || n.div_ceil(GEMM_BN) * m.div_ceil(64) < slots / 4 {
        2
    } else {
        4
    };
    let mblocks = m.div_ceil(16 * mt);
    let nblocks = n.div_ceil(GEMM_BN);
    let base = mblocks * nblocks;
    // At least 4 k-tiles per split and at most 4 splits (bounds the fp32 workspace).
    let splits = pick_splits(base, slots, 1, (tiles / 4).clamp(1, 4));
    let per = tiles.div_ceil(splits).max(1);
    let splits = tiles.div_ceil(per);
    GemmPlan {
        kernel: GemmKernel::Tiled { mt },
        nblocks,
        mblocks,
        splits,
        cluster: false,
        k_chunk: per * GEMM_BK,
        smem: 0,
        threads: GEMM_THREADS,
        block_n: GEMM_BN,
    }
}

fn gemm_kernel_name(act: DType, plan: &GemmPlan) -> Result<&'static str> {
    let suffix = act.suffix();
    let name = match plan.kernel {
        GemmKernel::Gemv => format!("w4a16_gemv_{suffix}"),
        GemmKernel::Gemv3 { rows } => format!("w4a16_gemv3_{suffix}_r{rows}"),
        GemmKernel::Tiled { mt } => format!("w4a16_awq_{suffix}_m{mt}"),
        GemmKernel::Wgmma { tokens } => return wg_kernel_name(act, tokens),
    };
    kernel_named(name)
}

/// The plain wgmma kernel of `tokens` for `act` activations.
fn wg_kernel_name(act: DType, tokens: usize) -> Result<&'static str> {
    kernel_named(format!("w4a16_wg_{}_t{tokens}", act.suffix()))
}

/// The kernel entry point called `name`.
fn kernel_named(name: String) -> Result<&'static str> {
    crate::kernels::all_kernels()
        .find(|k| *k == name)
        .ok_or(CudaError::MissingKernel(name))
}

/// A plan with its kernel and (when K is split) the reduction kernel.
type Cached<P> = (P, Func, Option<Func>);
/// A process-wide cache of plans by shape key.
type PlanCache<K, P> = OnceLock<Mutex<HashMap<K, Cached<P>>>>;

/// The cached plan for `key`, made once by `make` (kernel lookup, occupancy query) and then
/// served from `cache`: a launch costs one map lookup, no kernel-name formatting, no
/// occupancy query and no environment read.
fn cached_plan<K: std::hash::Hash + Eq, P: Copy>(
    cache: &'static PlanCache<K, P>,
    key: K,
    make: impl FnOnce() -> Result<Cached<P>>,
) -> Result<Cached<P>> {
    let plans = cache.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = plans.lock().ok().and_then(|p| p.get(&key).copied()) {
        return Ok(p);
    }
    let p = make()?;
    if let Ok(mut map) = plans.lock() {
        map.insert(key, p);
    }
    Ok(p)
}

/// The split-K reduction kernel for `act` when K is split in `splits > 1` parts.
fn reduce_kernel(dev: &Device, act: DType, splits: usize) -> Result<Option<Func>> {
    if splits <= 1 {
        return Ok(None);
    }
    let name = if act == DType::F16 {
        "w4a16_reduce_f16"
    } else {
        "w4a16_reduce_bf16"
    };
    Ok(Some(dev.function(name)?))
}

/// Largest fp32 split-K workspace over both activation dtypes: `outputs` floats per split of
/// the plan `splits_of` gives for each dtype.
fn split_workspace_bytes(
    outputs: usize,
    mut splits_of: impl FnMut(DType) -> Result<usize>,
) -> Result<usize> {
    let mut bytes = 0;
    for act in [DType::F16, DType::Bf16] {
        let splits = splits_of(act)?;
        if splits > 1 {
            bytes = bytes.max(splits * outputs * 4);
        }
    }
    Ok(bytes)
}

/// The GEMM plan for a shape, cached per (device, dtype, M, N, K, G).
fn plan_for(
    dev: &Device,
    act: DType,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<Cached<GemmPlan>> {
    static PLANS: PlanCache<(usize, DType, usize, usize, usize, usize), GemmPlan> = OnceLock::new();
    cached_plan(&PLANS, (dev.ordinal, act, m, n, k, group_size), || {
        let (plan, f) = plan_uncached(dev, act, m, n, k, group_size)?;
        Ok((plan, f, reduce_kernel(dev, act, plan.workspace_splits())?))
    })
}

fn plan_uncached(
    dev: &Device,
    act: DType,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<(GemmPlan, Func)> {
    // The GEMV path (power-of-two groups) depends on its shared memory for occupancy:
    // plan with an estimate first.
    let gemv_ok = group_size.is_power_of_two();
    let sms = dev.sm_count.max(1) as usize;
    let wg_ok = dev.cc == (9, 0) && wg_shape_ok(n, k, group_size);
    let probe = gemm_plan(
        sms * 4,
        m,
        n,
        k,
        gemv_ok,
        wg_ok.then(|| WgDevice::without_clusters(sms)),
    );
    let f = dev.function(gemm_kernel_name(act, &probe)?)?;
    let occ = dev.occupancy(f, probe.threads as u32, probe.smem);
    // Only consulted when the probe chose the wgmma kernel: asks the driver about the candidate
    // tile's own kernel (a missing or unloadable one is never clustered).
    let clustered = |(tokens, nblocks, mblocks, splits)| {
        wg_kernel_name(act, tokens)
            .and_then(|name| dev.function(name))
            .is_ok_and(|f| wg_clustered(dev, f, (nblocks, mblocks, splits), tokens))
    };
    let plan = gemm_plan(
        sms * occ,
        m,
        n,
        k,
        gemv_ok,
        wg_ok.then_some(WgDevice {
            sms,
            clustered: &clustered,
        }),
    );
    let f = dev.function(gemm_kernel_name(act, &plan)?)?;
    Ok((plan, f))
}

/// Whether the wgmma kernel `f` (of `tokens`) sums the K splits of a grid of (N blocks, M
/// blocks, splits) in thread block clusters on `dev`: [`cluster_pays`] on the device's cluster
/// occupancy at the plan's shared memory for that grid, unless `FORGE_GEMM_WG_CLUSTER` forces
/// either path.
fn wg_clustered(
    dev: &Device,
    f: Func,
    (nblocks, mblocks, splits): (usize, usize, usize),
    tokens: usize,
) -> bool {
    let forced = knobs().gemm_wg_cluster;
    if forced == Some(0) {
        return false;
    }
    let sms = dev.sm_count.max(1) as usize;
    let smem = wg_smem(nblocks * mblocks * splits, sms, tokens);
    let dims = (
        (nblocks as u32, mblocks as u32, splits as u32),
        (WG_THREADS as u32, 1, 1),
        smem,
    );
    let clusters = dev.max_active_clusters(f, dims, splits as u32);
    if forced.is_some() {
        return clusters > 0;
    }
    let slots = sms * dev.occupancy(f, WG_THREADS as u32, smem as usize);
    cluster_pays(nblocks * mblocks, splits, clusters, slots)
}

/// Most K splits the wgmma GEMM sums in a cluster when its clusters take several waves. H100,
/// µs warm (LOG.md, "Split-K in a cluster"): clusters of 4 over several waves gained
/// (7168×18432 at M = 64 / 128 85.5 / 91.4 through the workspace → 82.3 / 84.7–87.3), clusters
/// of 5–8 lost (16384×7168 at M = 64 / 128 split 7 ways: 85–87 against 67.5–72.8); in a single
/// wave clusters of 8 gained (7168×1536 at M = 128: 13.2–13.4 against 14.0–14.1).
const WG_MAX_CLUSTER_WAVES: usize = 4;

/// Whether the wgmma GEMM sums its `splits` in clusters: `base` clusters of `splits` blocks, of
/// which the device holds `clusters` at once, against the same `base · splits` blocks on `slots`
/// block slots through the workspace. Not when the clusters take more waves (a cluster must fit
/// within one GPC, which can leave SMs idle: 16 clusters of 7 or 8 blocks of 7168×2048 took
/// 23–27 µs against 13–15), nor when clusters of more than [`WG_MAX_CLUSTER_WAVES`] blocks take
/// more than one wave.
fn cluster_pays(base: usize, splits: usize, clusters: usize, slots: usize) -> bool {
    let waves = base.div_ceil(clusters.max(1));
    clusters > 0
        && waves <= (base * splits).div_ceil(slots.max(1))
        && (splits <= WG_MAX_CLUSTER_WAVES || waves == 1)
}

/// Bytes of fp32 workspace [`w4a16_gemm_awq`] needs for this shape on `device` (0 when it
/// does not split K).
pub fn w4a16_workspace_bytes(
    device_ordinal: usize,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<usize> {
    let dev = device(device_ordinal)?;
    split_workspace_bytes(m * n, |act| {
        Ok(plan_for(dev, act, m, n, k, group_size)?
            .0
            .workspace_splits())
    })
}

/// What [`w4a16_gemm_awq`] launches for `(M, N, K, G)` with `act` activations on device
/// `device_ordinal`, in words: the kernel, its grid (N blocks × M blocks × K splits) and
/// whether the splits are summed in a thread block cluster. For benches and tuning: the plan
/// cache answers after the first call.
pub fn w4a16_plan(
    device_ordinal: usize,
    act: DType,
    m: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<String> {
    check_act(act)?;
    let dev = device(device_ordinal)?;
    let plan = plan_for(dev, act, m, n, k, group_size)?.0;
    let name = gemm_kernel_name(act, &plan)?;
    let sum = match (plan.splits, plan.cluster) {
        (1, _) => "",
        (_, true) => ", summed in a cluster",
        (_, false) => ", summed through the workspace",
    };
    Ok(format!(
        "{name} {}x{}x{} (K {} a split{sum})",
        plan.nblocks, plan.mblocks, plan.splits, plan.k_chunk
    ))
}

/// The activation dtypes the W4A16 kernels take: F16 or Bf16.
fn check_act(act: DType) -> Result<()> {
    if matches!(act, DType::F16 | DType::Bf16) {
        return Ok(());
    }
    Err(CudaError::arg("act", "F16 or Bf16", format!("{act:?}")))
}

/// In features `k` a positive multiple of the group size `g`.
fn check_whole_groups(k: usize, g: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(g) {
        return Err(CudaError::arg(
            "k",
            format!("a positive multiple of group_size {g}"),
            k,
        ));
    }
    Ok(())
}

/// Out features of the fused W4A16 kernels are a multiple of this (AWQ allows any multiple of
/// 8: `forge.runtime` takes other layers through the dense dequantization and cuBLAS).
pub const W4A16_N_MULTIPLE: usize = 32;

/// The weight shape both W4A16 launches need: `k` a positive multiple of the group size,
/// `n` a positive multiple of [`W4A16_N_MULTIPLE`].
fn check_w4a16_shape(n: usize, k: usize, g: usize) -> Result<()> {
    check_whole_groups(k, g)?;
    if n == 0 || !n.is_multiple_of(W4A16_N_MULTIPLE) {
        return Err(CudaError::arg(
            "n",
            format!("a positive multiple of {W4A16_N_MULTIPLE}"),
            n,
        ));
    }
    Ok(())
}

/// Arguments of [`w4a16_gemm_awq`]: `y = x · dequant(W)ᵀ` for a linear of `n` out features
/// × `k` in features stored in the AWQ layout (as [`awq_quantize_pack`] writes it), on `m`
/// rows of activations. All tensors row-major and contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct W4a16Gemm {
    /// Activations `[M, K]` of `act`, 16-byte aligned.
    pub x: u64,
    /// Activation (and output) dtype: F16 or Bf16.
    pub act: DType,
    /// Rows of `x` and `y` (tokens): positive.
    pub m: usize,
    /// Out features: a positive multiple of 32.
    pub n: usize,
    /// In features: a positive multiple of `group_size`.
    pub k: usize,
    /// AWQ group size `G`: a positive multiple of 32.
    pub group_size: usize,
    /// i32 `[K, N/8]` AWQ-packed codes (see [`PackedOut::qweight`]), 16-byte aligned.
    pub qweight: u64,
    /// i32 `[K/G, N/8]` AWQ-packed zero points, 16-byte aligned.
    pub qzeros: u64,
    /// f16 `[K/G, N]` group scales, 16-byte aligned.
    pub scales: u64,
    /// Output `[M, N]` of `act`, 2-byte aligned.
    pub y: u64,
    /// fp32 split-K scratch of [`w4a16_workspace_bytes`] bytes (16-byte aligned), or 0 to
    /// allocate it stream-ordered on the launch's stream when K is split.
    pub workspace: u64,
    /// Bytes at `workspace`.
    pub workspace_bytes: usize,
}

impl W4a16Gemm {
    /// Checks dtype, sizes, divisibility and pointer alignment without touching the driver
    /// (the workspace is checked against the shape's plan by the launch, when K is split).
    pub fn validate(&self) -> Result<()> {
        check_act(self.act)?;
        check_nonzero("m", self.m)?;
        let g = self.group_size;
        if g == 0 || !g.is_multiple_of(32) {
            return Err(CudaError::arg("group_size", "a positive multiple of 32", g));
        }
        check_w4a16_shape(self.n, self.k, g)?;
        to_i32("m", self.m)?;
        to_i32("n", self.n)?;
        to_i32("k", self.k)?;
        check_align("x", self.x, 16)?;
        check_align("qweight", self.qweight, 16)?;
        // 16: the tiled and wgmma kernels copy it in 16-byte chunks (cp.async).
        check_align("qzeros", self.qzeros, 16)?;
        check_align("scales", self.scales, 16)?;
        check_align("y", self.y, 2)?;
        Ok(())
    }
}

/// `y[M, N] = x[M, K] · dequant(W)ᵀ` reading the AWQ tensors directly (see [`W4a16Gemm`]);
/// fp32 accumulation on tensor cores. For bf16 activations the weights are dequantised as
/// `(q − z)·bf16(scale)` rounded to bf16 (as vLLM does with bf16 scales). Every argument is
/// checked by [`W4a16Gemm::validate`] before the driver is touched.
///
/// When K is split (small M) an fp32 workspace of [`w4a16_workspace_bytes`] is needed: pass
/// it (`workspace`, `workspace_bytes`), or 0 to allocate it stream-ordered on `s`.
///
/// # Safety
/// See the module documentation.
pub unsafe fn w4a16_gemm_awq(a: &W4a16Gemm, s: Stream) -> Result<()> {
    a.validate()?;
    let (m, n, k, group_size) = (a.m, a.n, a.k, a.group_size);
    let dev = dev_of(s)?;
    let (plan, f, reduce) = plan_for(dev, a.act, m, n, k, group_size)?;
    let (splits, k_chunk) = (plan.splits, plan.k_chunk);
    let block_x = plan.block_n;
    let threads = plan.threads as u32;
    let grid = (blocks(n, block_x)?, plan.mblocks as u32, splits as u32);
    let smem = plan.smem as u32;
    let (mut mm, mut nn, mut kk, mut g, mut kc) = (
        to_i32("m", m)?,
        to_i32("n", n)?,
        to_i32("k", k)?,
        if plan.kernel.takes_log2_group() {
            group_size.trailing_zeros() as i32
        } else {
            group_size as i32
        },
        k_chunk as i32,
    );
    let (mut px, mut pqw, mut pqz, mut psc) = (a.x, a.qweight, a.qzeros, a.scales);
    let run = |p: &mut [*mut c_void]| {
        // SAFETY: the caller's parameter list matches w4a16_awq_<dt>_m<MT> / w4a16_wg_<dt>;
        // a programmatic kernel calls pdl_wait before it touches memory.
        unsafe {
            if plan.kernel.programmatic() {
                launch_programmatic(dev, f, (grid, (threads, 1, 1), smem), s.handle, p)
            } else {
                launch(dev, f, grid, (threads, 1, 1), smem, s.handle, p)
            }
        }
    };
    if splits == 1 {
        let (mut out, mut split_out) = (a.y, WG_OUT_Y);
        return run(&mut args!(
            px, pqw, pqz, psc, out, mm, nn, kk, g, kc, split_out
        ));
    }
    if plan.cluster {
        // The wgmma kernel's WG_OUT_CLUSTER: the splits of a tile sum their partials in their
        // cluster's shared memory and write y themselves.
        let (mut out, mut split_out) = (a.y, WG_OUT_CLUSTER);
        let p = &mut args!(px, pqw, pqz, psc, out, mm, nn, kk, g, kc, split_out);
        // SAFETY: the parameter list matches w4a16_wg_<dt>, which calls pdl_wait before it
        // touches memory and keeps each block until its cluster has read its tile.
        return unsafe {
            launch_clustered(
                dev,
                f,
                (grid, (threads, 1, 1), smem),
                splits as u32,
                s.handle,
                p,
            )
        };
    }
    let mut launch_partials = |ws: u64| {
        let (mut out, mut split_out) = (ws, WG_OUT_PARTIALS);
        // ws holds splits·M·N floats.
        run(&mut args!(
            px, pqw, pqz, psc, out, mm, nn, kk, g, kc, split_out
        ))
    };
    // SAFETY: y holds M·N outputs; the workspace per the caller's contract.
    unsafe {
        split_k(
            dev,
            reduce,
            splits,
            m * n,
            a.y,
            (a.workspace, a.workspace_bytes),
            s,
            &mut launch_partials,
        )
    }
}

// ---------------------------------------------------------------------------------------
// (c1) W4A16 GEMV on the tile layout (the AWQ codes repacked once at load time)

/// Most tokens [`w4a16_gemv_tiled`] takes: two 8-token tiles of the MMA's B columns.
pub const TILED_MAX_M: usize = 16;
/// The tile layout's divisors (`forge_core::pack::tile_awq`): `n % TILE_N == 0`,
/// `k % TILE_K == 0`, and here `group_size % TILE_K == 0`.
pub use forge_core::pack::{TILE_K, TILE_N};

/// The shapes the tile layout (and its GEMV) takes: `n` a positive multiple of [`TILE_N`],
/// `k` and `group_size` positive multiples of [`TILE_K`], `k` a multiple of `group_size`.
pub fn tile_shape_ok(n: usize, k: usize, group_size: usize) -> bool {
    n > 0
        && n.is_multiple_of(TILE_N)
        && group_size > 0
        && group_size.is_multiple_of(TILE_K)
        && k > 0
        && k.is_multiple_of(group_size)
}

fn check_tile_shape(n: usize, k: usize, group_size: usize) -> Result<()> {
    if tile_shape_ok(n, k, group_size) {
        return Ok(());
    }
    Err(CudaError::arg(
        "shape",
        format!("N % {TILE_N} == 0, G % {TILE_K} == 0 and K % G == 0 (all positive)"),
        format!("N={n} K={k} G={group_size}"),
    ))
}

/// Repacks an AWQ `qweight [K, N/8]` (i32, contiguous, 4-byte aligned) into the tile layout
/// `out` (the same number of words; `cuda/gemm.cu` documents the layout). Bit-identical to
/// `forge_core::pack::tile_awq`. Needs `N % 16 == 0` and `K % 64 == 0`.
///
/// # Safety
/// See the module documentation.
pub unsafe fn w4a16_tile_repack(
    qweight: u64,
    out: u64,
    n: usize,
    k: usize,
    s: Stream,
) -> Result<()> {
    check_tile_shape(n, k, TILE_K)?;
    check_align("qweight", qweight, 4)?;
    check_align("out", out, 16)?;
    let dev = dev_of(s)?;
    let f = dev.function("w4a16_tile_repack")?;
    let words = k * n / 8;
    let (mut pq, mut po, mut kk, mut nn) = (qweight, out, to_i32("k", k)?, to_i32("n", n)?);
    let mut p = args!(pq, po, kk, nn);
    let grid = (blocks(words, 256)?, 1, 1);
    // SAFETY: parameter list matches w4a16_tile_repack; both buffers hold K·N/8 words.
    unsafe { launch(dev, f, grid, (256, 1, 1), 0, s.handle, &mut p) }
}

/// Arguments of [`awq_dequant`]: the AWQ tensors of a linear of `n` out features × `k` in
/// features dequantized to a dense row-major `out [K, N]` (qweight's own order, so that
/// `x · out` is the layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AwqDequant {
    /// Out features: a positive multiple of 8.
    pub n: usize,
    /// In features: a positive multiple of `group_size`.
    pub k: usize,
    /// AWQ group size `G`: positive.
    pub group_size: usize,
    /// i32 `[K, N/8]` AWQ-packed codes, 4-byte aligned.
    pub qweight: u64,
    /// i32 `[K/G, N/8]` AWQ-packed zero points, 4-byte aligned.
    pub qzeros: u64,
    /// f16 `[K/G, N]` group scales, 16-byte aligned.
    pub scales: u64,
    /// Output `[K, N]` of `out_dtype`, 16-byte aligned.
    pub out: u64,
    /// F32, F16 or Bf16.
    pub out_dtype: DType,
}

impl AwqDequant {
    /// Checks dtype, sizes, divisibility and pointer alignment without touching the driver.
    pub fn validate(&self) -> Result<()> {
        if self.out_dtype == DType::F8E4M3 {
            return Err(CudaError::arg("out_dtype", "F32, F16 or Bf16", "F8E4M3"));
        }
        check_nonzero("group_size", self.group_size)?;
        check_whole_groups(self.k, self.group_size)?;
        if self.n == 0 || !self.n.is_multiple_of(8) {
            return Err(CudaError::arg("n", "a positive multiple of 8", self.n));
        }
        to_i32("n", self.n)?;
        to_i32("k", self.k)?;
        check_align("qweight", self.qweight, 4)?;
        check_align("qzeros", self.qzeros, 4)?;
        check_align("scales", self.scales, 16)?;
        check_align("out", self.out, 16)?;
        Ok(())
    }
}

/// Dequantizes AWQ tensors to a dense `[K, N]` (see [`AwqDequant`]): `(q − z)·s` in fp32,
/// rounded once to the output dtype, with a bf16 output's scale first rounded to bf16. So the
/// f16 and bf16 outputs are, bit for bit, the weights [`w4a16_gemm_awq`] multiplies, and the
/// f32 output is `forge_core::matmul::dequantize_awq` transposed. Checked by
/// [`AwqDequant::validate`] before the driver is touched.
///
/// # Safety
/// See the module documentation.
pub unsafe fn awq_dequant(a: &AwqDequant, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let f = dev.function(kname("awq_dequant", a.out_dtype)?)?;
    let words = a.n / 8;
    let grid = (blocks(words, 256)?, a.k.min(65535) as u32, 1);
    let (mut pq, mut pz, mut ps, mut po) = (a.qweight, a.qzeros, a.scales, a.out);
    let (mut kk, mut nn, mut g) = (
        to_i32("k", a.k)?,
        to_i32("n", a.n)?,
        to_i32("group_size", a.group_size)?,
    );
    let mut p = args!(pq, pz, ps, po, kk, nn, g);
    // SAFETY: parameter list matches awq_dequant_<dt>; the buffers hold the documented sizes.
    unsafe { launch(dev, f, grid, (256, 1, 1), 0, s.handle, &mut p) }
}

/// Arguments of [`w4a16_gemv_tiled`]: `y = x · dequant(W)ᵀ` for `m <= 16` tokens with the
/// codes in the tile layout ([`w4a16_tile_repack`]) and the zero points and scales as AWQ
/// stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TiledGemv {
    /// Activations `[M, K]` of `act`, 16-byte aligned.
    pub x: u64,
    /// Activation (and output) dtype: F16 or Bf16.
    pub act: DType,
    /// Tokens: 1..=[`TILED_MAX_M`].
    pub m: usize,
    /// Out features: a positive multiple of [`TILE_N`].
    pub n: usize,
    /// In features: a positive multiple of `group_size`.
    pub k: usize,
    /// AWQ group size: a positive multiple of [`TILE_K`].
    pub group_size: usize,
    /// u32 `[N/16, K/64, 32, 4]` tile-layout codes, 16-byte aligned.
    pub qweight_tiled: u64,
    /// i32 `[K/G, N/8]` AWQ-packed zero points, 4-byte aligned.
    pub qzeros: u64,
    /// f16 `[K/G, N]` group scales, 2-byte aligned.
    pub scales: u64,
    /// Output `[M, N]` of `act`, 2-byte aligned.
    pub y: u64,
}

impl TiledGemv {
    /// Checks dtype, sizes and pointer alignment without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_act(self.act)?;
        check_count("m", self.m, TILED_MAX_M)?;
        check_tile_shape(self.n, self.k, self.group_size)?;
        to_i32("n", self.n)?;
        to_i32("k", self.k)?;
        check_align("x", self.x, 16)?;
        check_align("qweight_tiled", self.qweight_tiled, 16)?;
        check_align("qzeros", self.qzeros, 4)?;
        check_align("scales", self.scales, 2)?;
        check_align("y", self.y, 2)?;
        Ok(())
    }
}

/// Warps per block of the tiled GEMV (at most `max_warps`, the kernel's, and no more than
/// `groups`: a warp takes whole groups), for `tiles` blocks of `groups` K-groups of
/// `group_chunks` 64-wide chunks each on `sms` SMs, `blocks_per_sm(w)` of `w` warps resident
/// at once. A block's warps take `ceil(groups / w)` groups each (the busiest warp sets the
/// block's time, `b`) and an SM starts a block whenever one of its slots frees, so the
/// `tiles` blocks on `slots = sms · blocks_per_sm(w)` take about `max(1, tiles / slots) · b`
/// plus, past one round, the last block's `b` (list scheduling's bound), plus each round's
/// ramp: the fewest `(max(1, tiles / slots) + [tiles > slots]) · b + TILED_WAVE_GROUPS ·
/// ceil(tiles / slots)` wins, ties to more warps, and then the fewest warps that give each
/// the same groups (no warp without groups). Once every SM has a block (`tiles >= sms`) a
/// warp keeps at least [`TILED_MIN_CHUNKS`] chunks (above 4 warps): a warp pays its first
/// loads' latency alone, and more warps add no SMs.
/// On an H200, over ten DeepSeek-V3 shapes at M = 1 (4 to 32 warps each, LOG.md, "Warps a
/// block, swept"), this picks a count within 1 % of the fastest on each, where whole waves
/// (`ceil(tiles / slots) · (TILED_WAVE_GROUPS + b)`) ran 2048x7168 at 8 warps in 5.96 µs
/// against 4 warps' 5.44, and 7168x18432 (1152 tiles of 56 groups) at 6 in 26.6 against 8
/// warps' 25.1; at M = 16 both pick the same counts.
fn tiled_warps(
    sms: usize,
    tiles: usize,
    groups: usize,
    group_chunks: usize,
    max_warps: usize,
    blocks_per_sm: impl Fn(usize) -> usize,
) -> usize {
    let cost = |w: usize| {
        let slots = sms * blocks_per_sm(w).max(1);
        let b = groups.div_ceil(w);
        let rounds = tiles as f64 / slots as f64;
        let tail = if tiles > slots { 1.0 } else { 0.0 };
        (rounds.max(1.0) + tail) * b as f64 + (TILED_WAVE_GROUPS * tiles.div_ceil(slots)) as f64
    };
    let short =
        |w: usize| w > 4 && tiles >= sms && groups.div_ceil(w) * group_chunks < TILED_MIN_CHUNKS;
    let w = (4..=groups.clamp(4, max_warps))
        .rev()
        .filter(|&w| !short(w))
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(4);
    groups.div_ceil(groups.div_ceil(w)).max(4)
}

/// The most warps a block of the M <= 8 tiled GEMV has: its `__launch_bounds__` and the size
/// of its reduction in shared memory, emitted into the kernels' generated header. Its 64
/// registers allow 1024 threads.
pub(crate) const TILED_MAX_WARPS: usize = 32;
/// The same for the M > 8 kernel (78 registers from NVRTC 13.0 for sm_90a).
pub(crate) const TILED16_MAX_WARPS: usize = 16;
/// A round's ramp in the time of one group a warp: from 2 to 4 the H200 sweep's picks are the
/// same (LOG.md, "Warps a block, swept").
const TILED_WAVE_GROUPS: usize = 4;
/// The fewest 64-wide chunks of weights a warp takes once every SM has a block (8 to 12 pick
/// the same counts in the H200 sweep): 4 times the 2 it keeps in flight.
const TILED_MIN_CHUNKS: usize = 8;

/// One of the two tiled GEMV kernels (M <= 8 and 8 < M <= 16): its entry points, its most
/// warps a block, and the dynamic shared memory a warp of a launch takes (the M <= 8 kernel's
/// final-sum buffer, 16 rows × 8 tokens of fp32 a warp; the M > 8 kernel's is static, gemm.cu
/// `w4a16_gemv_tiled_impl`).
struct TiledKernel {
    f16: &'static str,
    bf16: &'static str,
    max_warps: usize,
    smem_per_warp: usize,
}

const TILED8: TiledKernel = TiledKernel {
    f16: "w4a16_gemv_tiled_f16",
    bf16: "w4a16_gemv_tiled_bf16",
    max_warps: TILED_MAX_WARPS,
    smem_per_warp: 16 * 8 * 4,
};
const TILED16: TiledKernel = TiledKernel {
    f16: "w4a16_gemv_tiled16_f16",
    bf16: "w4a16_gemv_tiled16_bf16",
    max_warps: TILED16_MAX_WARPS,
    smem_per_warp: 0,
};

/// The tiled GEMV's warps a block for a shape (`FORGE_TILED_WARPS`, a tuning aid, forces the
/// count; see [`Knobs`]) and entry point `name` of `kernel`, cached per (device, entry, N, K, G).
fn tiled_plan(
    dev: &Device,
    kernel: &TiledKernel,
    name: &'static str,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<(usize, Func)> {
    static PLANS: PlanCache<(usize, &'static str, usize, usize, usize), usize> = OnceLock::new();
    let (warps, f, _) = cached_plan(&PLANS, (dev.ordinal, name, n, k, group_size), || {
        let f = dev.function(name)?;
        let sms = dev.sm_count.max(1) as usize;
        let warps = match knobs().tiled_warps {
            Some(w) => w.min(kernel.max_warps),
            None => tiled_warps(
                sms,
                n / TILE_N,
                k / group_size,
                group_size / 64,
                kernel.max_warps,
                |w| dev.occupancy(f, (32 * w) as u32, w * kernel.smem_per_warp),
            ),
        };
        Ok((warps, f, None))
    })?;
    Ok((warps, f))
}

/// `y[M, N] = x[M, K] · dequant(W)ᵀ` for `M <= 16` from the tile layout (see [`TiledGemv`]):
/// one launch, tensor cores with the weights as A (M > 8: each dequantized fragment serves
/// both 8-token tiles), fp32 accumulation, each group's sum scaled once in fp32 (weights are
/// `(q − z)` exactly, times the f16 scale in fp32). Deterministic.
///
/// # Safety
/// See the module documentation.
pub unsafe fn w4a16_gemv_tiled(a: &TiledGemv, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let kernel = if a.m > 8 { &TILED16 } else { &TILED8 };
    let name = if a.act == DType::F16 {
        kernel.f16
    } else {
        kernel.bf16
    };
    let (warps, f) = tiled_plan(dev, kernel, name, a.n, a.k, a.group_size)?;
    let (mut px, mut pq, mut pz, mut ps, mut py) = (a.x, a.qweight_tiled, a.qzeros, a.scales, a.y);
    let (mut mm, mut nn, mut kk, mut g) = (
        a.m as i32,
        to_i32("n", a.n)?,
        to_i32("k", a.k)?,
        a.group_size as i32,
    );
    let mut p = args!(px, pq, pz, ps, py, mm, nn, kk, g);
    let grid = (blocks(a.n, TILE_N)?, 1, 1);
    // SAFETY: parameter list matches w4a16_gemv_tiled_<dt>.
    unsafe {
        launch(
            dev,
            f,
            grid,
            ((32 * warps) as u32, 1, 1),
            (warps * kernel.smem_per_warp) as u32,
            s.handle,
            &mut p,
        )
    }
}

// ---------------------------------------------------------------------------------------
// (c2) grouped W4A16 GEMV (MoE experts at decode) and its tensor-core form (prefill)

/// Rows per segment the grouped GEMV supports (its kernel variants).
pub const GROUPED_ROWS: [usize; 3] = [1, 2, 4];
/// Rows per segment of the grouped form on tensor cores, a segment a block: on an sm_90 GPU
/// the wgmma kernel's token tiles (`w4a16_wgg_<dt>_t<rows>`, for the shapes it takes), else
/// the mma.sync kernel's (`w4a16_awqg_<dt>_m<rows / 16>`, at most [`GROUPED_MMA_MAX_ROWS`]);
/// see [`grouped_tc_max_rows`]. 256 rows (the wgmma kernel's widest tile, one block an SM) pay
/// only for long K and many rows an expert; `forge.runtime` takes them by that rule.
pub const GROUPED_TC_ROWS: [usize; 5] = [16, 32, 64, 128, 256];
/// Most rows per segment of the grouped form's mma.sync kernel (its m16 tiles a block, 1 to 4).
pub const GROUPED_MMA_MAX_ROWS: usize = 64;

/// Which kernel runs the grouped form on tensor cores for experts of `k` in features, `n` out
/// features and group size `g` on a device of compute capability `cc`: the wgmma kernel on an
/// sm_90 GPU (`n` a multiple of 128, `k` and `g` multiples of 64; unless `FORGE_GEMM_WG=0`),
/// else the mma.sync kernel on sm_80 and later (`n` a multiple of 32, `g` of 32); None when
/// neither runs. `k` a positive multiple of `g` for both.
fn grouped_tc_form(cc: (i32, i32), n: usize, k: usize, g: usize) -> Option<GroupedForm> {
    if g == 0 || k == 0 || !k.is_multiple_of(g) {
        return None;
    }
    if cc == (9, 0) && !knobs().wgmma_off && wg_shape_ok(n, k, g) {
        return Some(GroupedForm::Wgmma);
    }
    (cc >= (8, 0) && grouped_mma_shape_ok(n, g)).then_some(GroupedForm::Mma)
}

/// The SIMT grouped GEMV's shape rule (rows 1, 2 and 4): a power-of-two group of at least 32,
/// `k` whole groups and `n` a positive multiple of 32.
fn grouped_gemv_shape(n: usize, k: usize, g: usize) -> Result<()> {
    if g < 32 || !g.is_power_of_two() {
        return Err(CudaError::arg("group_size", "a power of two >= 32", g));
    }
    check_w4a16_shape(n, k, g)
}

/// Whether the grouped GEMV (rows 1, 2 and 4 of [`GROUPED_ROWS`]) takes experts of `k` in
/// features, `n` out features and group size `group_size`: the rule [`GroupedGemv::validate`]
/// applies, asked without arguments to check (the runtime picks its path by it).
pub fn grouped_gemv_shape_ok(n: usize, k: usize, group_size: usize) -> bool {
    grouped_gemv_shape(n, k, group_size).is_ok()
}

fn grouped_mma_shape_ok(n: usize, g: usize) -> bool {
    n > 0 && n.is_multiple_of(32) && g.is_multiple_of(GEMM_BK)
}

/// Most rows per segment (one of [`GROUPED_TC_ROWS`]) with which device `device_ordinal` runs
/// the grouped form on tensor cores for experts of `k` in features, `n` out features and group
/// size `group_size`: 256 where the wgmma kernel runs (sm_90), [`GROUPED_MMA_MAX_ROWS`] where the
/// mma.sync kernel does (sm_80 and later, `n` a multiple of 32, the group of 32), 0 where
/// neither does.
pub fn grouped_tc_max_rows(
    device_ordinal: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<usize> {
    let dev = device(device_ordinal)?;
    Ok(tc_max_rows(grouped_tc_form(dev.cc, n, k, group_size)))
}

/// Most rows per segment of a grouped form on tensor cores (0: none).
fn tc_max_rows(form: Option<GroupedForm>) -> usize {
    match form {
        Some(GroupedForm::Wgmma) => GROUPED_TC_ROWS[GROUPED_TC_ROWS.len() - 1],
        Some(GroupedForm::Mma) => GROUPED_MMA_MAX_ROWS,
        _ => 0,
    }
}
/// Largest segment table the grouped GEMV takes (the grid's y extent).
pub const GROUPED_MAX_SEGMENTS: usize = GRID_Y_MAX;
/// Largest grid y extent of a launch.
const GRID_Y_MAX: usize = 65535;

/// Arguments of [`w4a16_grouped_gemv_awq`]: MoE experts over stacked AWQ tensors, one
/// launch for every (token, expert) pair.
///
/// The pairs are sorted by expert; a *segment* is a run of up to `rows` sorted positions
/// that share one expert. `segments` is an i32 table `[num_segments, 3]` of
/// (first sorted position, row count 0..=rows, expert id); rows past the real segments
/// hold count 0 and do nothing, and an expert id outside `[0, experts)` writes zeros
/// (expert-parallel masking). Sorted position `p` reads activation row `x_rows[p]` of `x`
/// and writes output row `out_rows[p]` of `y [pairs, N]`: with `x` = hidden states and
/// `x_rows` = the token of each pair, gate_up reads the tokens without a gathered copy.
/// Every output row must be named by exactly one position of a segment (else it is left
/// unwritten).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedGemv {
    /// Activations `[*, K]` of `act` (F16 or Bf16), 16-byte aligned; rows read through
    /// `x_rows`.
    pub x: u64,
    /// Activation (and output) dtype.
    pub act: DType,
    /// i32 `[pairs]`: the row of `x` each sorted position reads.
    pub x_rows: u64,
    /// i32 `[pairs]`: the row of `y` each sorted position writes (`< pairs`).
    pub out_rows: u64,
    /// Rows of `y` (entries of `x_rows` and `out_rows`).
    pub pairs: usize,
    /// i32 `[num_segments, 3]` segment table.
    pub segments: u64,
    /// Rows of the segment table (the launch's grid y; an upper bound on real segments).
    pub num_segments: usize,
    /// Most rows per segment: 1, 2 or 4 (the SIMT GEMV's variants), or 16, 32, 64, 128 or 256
    /// ([`GROUPED_TC_ROWS`]: the form on tensor cores, up to [`grouped_tc_max_rows`] for the
    /// device and shape; K is not split, no workspace).
    pub rows: usize,
    /// Experts in the stacked tensors.
    pub experts: usize,
    /// In features.
    pub k: usize,
    /// Out features.
    pub n: usize,
    /// AWQ group size dividing K: a power of two ≥ 32 for the SIMT GEMV, a multiple of 32 on
    /// tensor cores (of 64 for the wgmma kernel).
    pub group_size: usize,
    /// i32 `[experts, K, N/8]` (expert `e` at `e · expert_strides[0]` elements).
    pub qweight: u64,
    /// i32 `[experts, K/G, N/8]` (expert `e` at `e · expert_strides[1]` elements).
    pub qzeros: u64,
    /// f16 `[experts, K/G, N]` (expert `e` at `e · expert_strides[2]` elements).
    pub scales: u64,
    /// Elements from one expert to the next in `qweight`, `qzeros`, `scales`.
    pub expert_strides: [usize; 3],
    /// Output `[pairs, N]` of `act`.
    pub y: u64,
    /// fp32 split-K scratch of [`w4a16_grouped_workspace_bytes`] bytes, or 0 to allocate
    /// it stream-ordered.
    pub workspace: u64,
    /// Bytes at `workspace`.
    pub workspace_bytes: usize,
}

impl GroupedGemv {
    /// Expert strides of contiguous stacks `[experts, ...]` for this shape.
    pub fn dense_strides(k: usize, n: usize, group_size: usize) -> [usize; 3] {
        let groups = k / group_size.max(1);
        [k * (n / 8), groups * (n / 8), groups * n]
    }

    /// Checks dtype, sizes, strides and pointer alignment without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_act(self.act)?;
        let tc = check_grouped_rows(self.rows)?;
        check_nonzero("pairs", self.pairs)?;
        check_nonzero("experts", self.experts)?;
        check_count("num_segments", self.num_segments, GROUPED_MAX_SEGMENTS)?;
        let g = self.group_size;
        if tc {
            check_w4a16_shape(self.n, self.k, g)?;
        } else {
            grouped_gemv_shape(self.n, self.k, g)?;
        }
        // On tensor cores: the shapes one of the two kernels takes (which one runs is the
        // device's choice, at launch); the largest tile only on the wgmma kernel's.
        let mma_ok = self.rows <= GROUPED_MMA_MAX_ROWS && grouped_mma_shape_ok(self.n, g);
        if tc && !(mma_ok || wg_shape_ok(self.n, self.k, g)) {
            return Err(CudaError::arg(
                "(n, k, group_size)",
                format!(
                    "n a multiple of 128, k and group_size multiples of 64 for rows {} (up to \
                     rows {GROUPED_MMA_MAX_ROWS}: n and group_size multiples of 32)",
                    self.rows
                ),
                format!("({}, {}, {g})", self.n, self.k),
            ));
        }
        let dense = Self::dense_strides(self.k, self.n, g);
        // 16-byte chunks of every expert's tensors (the tensor-core kernels copy their zero
        // points so).
        let zeros_align = if tc { 4 } else { 1 };
        for (i, (name, align)) in [
            ("expert_strides[0] (qweight)", 4),
            ("expert_strides[1] (qzeros)", zeros_align),
            ("expert_strides[2] (scales)", 8),
        ]
        .into_iter()
        .enumerate()
        {
            let st = self.expert_strides[i];
            if (self.experts > 1 && st < dense[i]) || !st.is_multiple_of(align) {
                return Err(CudaError::arg(
                    name,
                    format!(
                        "at least one expert's {} elements and a multiple of {align}",
                        dense[i]
                    ),
                    st,
                ));
            }
        }
        to_i32("pairs", self.pairs)?;
        to_i32("experts", self.experts)?;
        check_align("x", self.x, 16)?;
        check_align("x_rows", self.x_rows, 4)?;
        check_align("out_rows", self.out_rows, 4)?;
        check_align("segments", self.segments, 4)?;
        check_align("qweight", self.qweight, 16)?;
        check_align("qzeros", self.qzeros, if tc { 16 } else { 4 })?;
        check_align("scales", self.scales, 16)?;
        check_align("y", self.y, 2)?;
        Ok(())
    }
}

/// Checks a grouped launch's rows per segment; true for the tensor-core form.
fn check_grouped_rows(rows: usize) -> Result<bool> {
    if GROUPED_TC_ROWS.contains(&rows) {
        return Ok(true);
    }
    if GROUPED_ROWS.contains(&rows) {
        return Ok(false);
    }
    let all = [&GROUPED_ROWS[..], &GROUPED_TC_ROWS[..]].concat();
    Err(CudaError::arg("rows", format!("one of {all:?}"), rows))
}

/// The kernel of a grouped launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupedForm {
    /// `w4a16_gemv3g_<dt>_r<rows>`: the SIMT GEMV, K split into a workspace where it pays.
    Simt,
    /// `w4a16_wgg_<dt>_t<rows>`: the Hopper wgmma kernel, 128 outputs a block.
    Wgmma,
    /// `w4a16_awqg_<dt>_m<rows / 16>`: the mma.sync kernel, 256 outputs a block.
    Mma,
}

/// How the grouped GEMV splits its work (cached per shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GroupedPlan {
    /// Blocks along N.
    nblocks: usize,
    /// K splits (blockIdx.z).
    splits: usize,
    /// K per split.
    k_chunk: usize,
    /// The kernel: its parameter list, threads and shared memory.
    form: GroupedForm,
}

/// Word columns per lane of the grouped kernel for `rows` (as the plain version 3).
fn grouped_block_n(rows: usize) -> usize {
    8 * 32 * gemv3_shape(rows).1
}

/// Split plan of the grouped GEMV: `slots` resident blocks, `segments` blocks along y.
fn grouped_plan(slots: usize, rows: usize, segments: usize, n: usize, k: usize) -> GroupedPlan {
    let nblocks = n.div_ceil(grouped_block_n(rows));
    let (splits, k_chunk) = gemv3_splits(nblocks * segments, slots, k);
    GroupedPlan {
        nblocks,
        splits,
        k_chunk,
        form: GroupedForm::Simt,
    }
}

/// The grouped plan for a shape, cached per (device, dtype, rows per segment, segments, N,
/// K, G).
fn grouped_plan_for(
    dev: &Device,
    act: DType,
    rows: usize,
    segments: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<Cached<GroupedPlan>> {
    type Key = (usize, DType, usize, usize, usize, usize, usize);
    static PLANS: PlanCache<Key, GroupedPlan> = OnceLock::new();
    let tc = check_grouped_rows(rows)?;
    // The tensor-core form's plan does not depend on the table's height (one block row a
    // segment): one entry for every prefill length.
    let key = (
        dev.ordinal,
        act,
        rows,
        if tc { 0 } else { segments },
        n,
        k,
        group_size,
    );
    cached_plan(&PLANS, key, || {
        if tc {
            let form = grouped_tc_form(dev.cc, n, k, group_size);
            let max_rows = tc_max_rows(form);
            if rows > max_rows {
                return Err(CudaError::arg(
                    "rows",
                    match max_rows {
                        0 => "1, 2 or 4 for this GPU and shape (no tensor-core form)".to_string(),
                        m => format!(
                            "1, 2 or 4, or 16 to {m} on tensor cores, for this GPU and shape"
                        ),
                    },
                    format!(
                        "{rows} on sm_{}{} with (n, k, group_size) ({n}, {k}, {group_size})",
                        dev.cc.0, dev.cc.1
                    ),
                ));
            }
            let (name, nblocks, form) = if form == Some(GroupedForm::Wgmma) {
                let name = format!("w4a16_wgg_{}_t{rows}", act.suffix());
                (name, n / WG_BN, GroupedForm::Wgmma)
            } else {
                let name = format!("w4a16_awqg_{}_m{}", act.suffix(), rows / 16);
                (name, n.div_ceil(GEMM_BN), GroupedForm::Mma)
            };
            let plan = GroupedPlan {
                nblocks,
                splits: 1,
                k_chunk: k,
                form,
            };
            return Ok((plan, dev.function(kernel_named(name)?)?, None));
        }
        let name = kernel_named(format!("w4a16_gemv3g_{}_r{rows}", act.suffix()))?;
        let f = dev.function(name)?;
        let sms = dev.sm_count.max(1) as usize;
        let occ = dev.occupancy(f, (32 * GEMV3_WARPS) as u32, 0);
        let plan = grouped_plan(sms * occ, rows, segments, n, k);
        Ok((plan, f, reduce_kernel(dev, act, plan.splits)?))
    })
}

/// Bytes of fp32 workspace [`w4a16_grouped_gemv_awq`] needs on `device` for `pairs` output
/// rows in a table of `num_segments` segments of up to `rows` rows (0 when it does not split
/// K). Both activation dtypes are covered.
pub fn w4a16_grouped_workspace_bytes(
    device_ordinal: usize,
    rows: usize,
    pairs: usize,
    num_segments: usize,
    n: usize,
    k: usize,
    group_size: usize,
) -> Result<usize> {
    if check_grouped_rows(rows)? {
        return Ok(0);
    }
    let dev = device(device_ordinal)?;
    split_workspace_bytes(pairs * n, |act| {
        Ok(
            grouped_plan_for(dev, act, rows, num_segments, n, k, group_size)?
                .0
                .splits,
        )
    })
}

/// Grouped W4A16 GEMV over stacked AWQ experts (see [`GroupedGemv`]): for every sorted
/// position `p` of a segment with expert `e`,
/// `y[out_rows[p]] = x[x_rows[p]] · dequant(W_e)ᵀ`, with the numerics of the version-3
/// GEMV of [`w4a16_gemm_awq`] (fp32 accumulation, `bf16(scale)` for bf16 activations,
/// K split into fp32 partials summed in a fixed order: deterministic). One launch (plus
/// the split-K reduction) whatever the routing: nothing is read back to the host, so it
/// can be captured in a CUDA graph.
///
/// # Safety
/// See the module documentation; besides, every `x_rows` entry of a real segment must be a
/// row of `x`, every `out_rows` entry `< pairs`, and the table's positions `< pairs`.
pub unsafe fn w4a16_grouped_gemv_awq(a: &GroupedGemv, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let (plan, f, reduce) =
        grouped_plan_for(dev, a.act, a.rows, a.num_segments, a.n, a.k, a.group_size)?;
    let grid = (
        plan.nblocks as u32,
        a.num_segments as u32,
        plan.splits as u32,
    );
    let (mut px, mut pxr, mut por, mut pseg) = (a.x, a.x_rows, a.out_rows, a.segments);
    let (mut pqw, mut pqz, mut psc) = (a.qweight, a.qzeros, a.scales);
    let (mut ew, mut ez, mut es) = (
        a.expert_strides[0] as i64,
        a.expert_strides[1] as i64,
        a.expert_strides[2] as i64,
    );
    let (mut ee, mut mm, mut nn, mut kk, mut gs, mut kc) = (
        a.experts as i32,
        a.pairs as i32,
        to_i32("n", a.n)?,
        to_i32("k", a.k)?,
        a.group_size.trailing_zeros() as i32,
        plan.k_chunk as i32,
    );
    if plan.form != GroupedForm::Simt {
        let (mut out, mut g) = (a.y, a.group_size as i32);
        let mut p = args!(px, pxr, por, pseg, pqw, pqz, psc, ew, ez, es, ee, out, nn, kk, g);
        let (block, smem) = match plan.form {
            GroupedForm::Wgmma => ((WG_THREADS as u32, 1, 1), wg_tile_smem(a.rows)),
            _ => ((GEMM_THREADS as u32, 1, 1), 0),
        };
        // SAFETY: parameter list matches w4a16_wgg_<dt>_t<rows> and w4a16_awqg_<dt>_m<mt>;
        // pointers per the caller's contract, checked above for alignment.
        return unsafe { launch(dev, f, grid, block, smem, s.handle, &mut p) };
    }
    let threads = (32 * GEMV3_WARPS) as u32;
    let mut go = |out: u64, split: bool| {
        let (mut out, mut split_out) = (out, split as i32);
        let mut p = args!(
            px, pxr, por, pseg, pqw, pqz, psc, ew, ez, es, ee, out, mm, nn, kk, gs, kc, split_out
        );
        // SAFETY: parameter list matches w4a16_gemv3g_<dt>_r<rows>; pointers per the
        // caller's contract, checked above for alignment.
        unsafe { launch(dev, f, grid, (threads, 1, 1), 0, s.handle, &mut p) }
    };
    if plan.splits == 1 {
        return go(a.y, false);
    }
    // SAFETY: y holds pairs·N outputs; the workspace per the caller's contract.
    unsafe {
        split_k(
            dev,
            reduce,
            plan.splits,
            a.pairs * a.n,
            a.y,
            (a.workspace, a.workspace_bytes),
            s,
            &mut |ws| go(ws, true),
        )
    }
}

/// Most pairs (tokens × top-k) [`moe_route`] takes in its one block.
pub const MOE_ROUTE_MAX_PAIRS: usize = 8192;
/// Most experts [`moe_route`] takes (its shared-memory bucket arrays).
pub const MOE_ROUTE_MAX_EXPERTS: usize = 1024;

/// Rows of the segment table for `pairs` pairs over `experts` experts plus the bucket of
/// masked ids, in runs of at most `rows` (the grouped GEMV's variant): an upper bound on
/// Σ ⌈c_b / rows⌉ over the non-empty buckets, at most `(pairs + nonempty·(rows − 1)) / rows`
/// and at most `pairs`; at least 1. Static for a call shape, so CUDA graphs can capture it.
pub fn moe_max_segments(pairs: usize, experts: usize, rows: usize) -> usize {
    let rows = rows.max(1);
    let nonempty = (experts + 1).min(pairs);
    pairs.min((pairs + nonempty * (rows - 1)) / rows).max(1)
}

/// Arguments of [`moe_route`]: the MoE routing table of the grouped GEMV, built on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeRoute {
    /// The router's top-k expert ids `[T, k]`, contiguous, int64 (`ids_i64`) or int32.
    pub ids: u64,
    /// Whether `ids` is int64 (8-byte aligned) rather than int32.
    pub ids_i64: bool,
    /// Pairs `T·k`: 1..=[`MOE_ROUTE_MAX_PAIRS`].
    pub pairs: usize,
    /// Experts per token `k`, dividing `pairs`.
    pub top_k: usize,
    /// Experts `E`: 1..=[`MOE_ROUTE_MAX_EXPERTS`]; ids outside `[0, E)` are gathered under `E`.
    pub experts: usize,
    /// Most pairs a segment (the grouped GEMV's variant, ≥ 1).
    pub rows: usize,
    /// int32 `[pairs]`: the pair index `t·k + j` at each sorted position (stable by expert).
    pub order: u64,
    /// int32 `[pairs]`: the token `order / k` at each sorted position.
    pub tokens: u64,
    /// int32 `[num_segments, 3]`: (first sorted position, count, expert id) per segment in
    /// sorted order, zero rows after the last.
    pub segments: u64,
    /// Rows of `segments`: at least [`moe_max_segments`]`(pairs, experts, rows)`.
    pub num_segments: usize,
}

impl MoeRoute {
    /// Checks sizes and pointers without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_count("pairs", self.pairs, MOE_ROUTE_MAX_PAIRS)?;
        if self.top_k == 0 || !self.pairs.is_multiple_of(self.top_k) {
            return Err(CudaError::arg(
                "top_k",
                format!("a positive divisor of pairs = {}", self.pairs),
                self.top_k,
            ));
        }
        check_count("experts", self.experts, MOE_ROUTE_MAX_EXPERTS)?;
        check_nonzero("rows", self.rows)?;
        let need = moe_max_segments(self.pairs, self.experts, self.rows);
        if self.num_segments < need {
            return Err(CudaError::arg(
                "num_segments",
                format!("at least {need} (moe_max_segments)"),
                self.num_segments,
            ));
        }
        to_i32("num_segments", 3 * self.num_segments)?;
        check_ids(self.ids, self.ids_i64)?;
        check_align("order", self.order, 4)?;
        check_align("tokens", self.tokens, 4)?;
        check_align("segments", self.segments, 4)?;
        Ok(())
    }
}

/// Sorts the (token, expert) pairs of a router's top-k ids by expert and cuts them into the
/// grouped GEMV's segments (see [`MoeRoute`]) in one launch of one block: no host sync, so
/// CUDA graphs capture it. Bit-identical to `forge.runtime.moe_segments` (torch ops).
///
/// # Safety
/// See the module documentation.
pub unsafe fn moe_route(a: &MoeRoute, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let f = dev.function("moe_route")?;
    let smem = ((a.pairs + 3 * (a.experts + 1)) * 4) as u32;
    let threads = a.pairs.next_multiple_of(32).min(1024) as u32;
    let (mut pi, mut po, mut pt, mut ps) = (a.ids, a.order, a.tokens, a.segments);
    let (mut i64f, mut pp, mut kk, mut ee, mut rr, mut ns) = (
        a.ids_i64 as i32,
        a.pairs as i32,
        a.top_k as i32,
        a.experts as i32,
        to_i32("rows", a.rows)?,
        a.num_segments as i32,
    );
    let mut p = args!(pi, i64f, pp, kk, ee, rr, ns, po, pt, ps);
    // SAFETY: parameter list matches moe_route; buffers per MoeRoute's contract, checked above.
    unsafe { launch(dev, f, (1, 1, 1), (threads, 1, 1), smem, s.handle, &mut p) }
}

/// Most tokens [`moe_combine`] takes (the grid's y extent).
pub const MOE_COMBINE_MAX_TOKENS: usize = GRID_Y_MAX;

/// Arguments of [`moe_combine`]: the top-k weighted sum of the grouped GEMV's per-pair rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeCombine {
    /// Per-pair outputs `[T·k, H]` of `act` (row `t·k + j` = token `t`'s `j`-th expert), 16-byte
    /// aligned.
    pub y: u64,
    /// Element type of `y` and `out`: F16 or Bf16.
    pub act: DType,
    /// The router's top-k weights `[T, k]`, contiguous.
    pub weights: u64,
    /// Element type of `weights`: F32, F16 or Bf16.
    pub weights_dtype: DType,
    /// The router's top-k expert ids `[T, k]`, contiguous, int64 (`ids_i64`) or int32; a pair
    /// whose id is outside `[0, experts)` adds nothing, whatever its weight.
    pub ids: u64,
    /// Whether `ids` is int64 rather than int32.
    pub ids_i64: bool,
    /// Tokens `T`: 1..=[`MOE_COMBINE_MAX_TOKENS`].
    pub tokens: usize,
    /// Experts per token `k` (≥ 1).
    pub top_k: usize,
    /// Hidden size `H`: a positive multiple of 8.
    pub hidden: usize,
    /// Experts `E`.
    pub experts: usize,
    /// Output `[T, H]` of `act`, 16-byte aligned.
    pub out: u64,
}

impl MoeCombine {
    /// Checks sizes, dtypes and pointers without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_act(self.act)?;
        moe_weight_kind(self.weights_dtype)?;
        check_count("tokens", self.tokens, MOE_COMBINE_MAX_TOKENS)?;
        check_nonzero("top_k", self.top_k)?;
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return Err(CudaError::arg(
                "hidden",
                "a positive multiple of 8",
                self.hidden,
            ));
        }
        to_i32("hidden", self.hidden)?;
        to_i32("experts", self.experts)?;
        to_i32("top_k", self.top_k)?;
        check_align("y", self.y, 16)?;
        check_align("weights", self.weights, self.weights_dtype.size() as u64)?;
        check_ids(self.ids, self.ids_i64)?;
        check_align("out", self.out, 16)?;
        Ok(())
    }
}

/// `moe_combine`'s `wkind` for the router weights' type: 0 F32, 1 Bf16, 2 F16.
fn moe_weight_kind(dt: DType) -> Result<i32> {
    match dt {
        DType::F32 => Ok(0),
        DType::Bf16 => Ok(1),
        DType::F16 => Ok(2),
        DType::F8E4M3 => Err(CudaError::arg(
            "weights_dtype",
            "F32, F16 or Bf16",
            "F8E4M3",
        )),
    }
}

/// `out[t] = Σ_j w'[t, j] · y[t·k + j]` (see [`MoeCombine`]) in one launch: fp32 products and
/// sums in `j` order, rounded once to the activation type.
///
/// # Safety
/// See the module documentation.
pub unsafe fn moe_combine(a: &MoeCombine, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let f = dev.function("moe_combine")?;
    let (mut py, mut pw, mut pi, mut po) = (a.y, a.weights, a.ids, a.out);
    let (mut wk, mut i64f, mut kk, mut hh, mut ee, mut bf) = (
        moe_weight_kind(a.weights_dtype)?,
        a.ids_i64 as i32,
        a.top_k as i32,
        a.hidden as i32,
        a.experts as i32,
        (a.act == DType::Bf16) as i32,
    );
    let mut p = args!(py, pw, wk, pi, i64f, kk, hh, ee, bf, po);
    let grid = (blocks(a.hidden / 8, 256)?, a.tokens as u32, 1);
    // SAFETY: parameter list matches moe_combine; buffers per MoeCombine's contract.
    unsafe { launch(dev, f, grid, (256, 1, 1), 0, s.handle, &mut p) }
}

/// Arguments of [`silu_mul`]: the experts' activation `silu(gate) · up` of their gate_up rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SiluMul {
    /// Input `[rows, 2·inter]` of `act`: a row's `inter` gate columns, then its `inter` up
    /// columns (the gate_up projection's output), 16-byte aligned.
    pub x: u64,
    /// Element type of `x` and `out`: F16 or Bf16.
    pub act: DType,
    /// Rows (≥ 1).
    pub rows: usize,
    /// Columns of each half, `inter`: a positive multiple of 8.
    pub inter: usize,
    /// Output `[rows, inter]` of `act`, 16-byte aligned.
    pub out: u64,
}

impl SiluMul {
    /// Checks sizes, dtype and pointers without touching the driver.
    pub fn validate(&self) -> Result<()> {
        check_act(self.act)?;
        check_nonzero("rows", self.rows)?;
        if self.inter == 0 || !self.inter.is_multiple_of(8) {
            return Err(CudaError::arg(
                "inter",
                "a positive multiple of 8",
                self.inter,
            ));
        }
        to_i32("2·inter", 2 * self.inter)?;
        let outputs = self
            .rows
            .checked_mul(self.inter)
            .ok_or_else(|| CudaError::arg("rows", "rows · inter below 2^63", self.rows))?;
        blocks(outputs / 8, 256)?;
        check_align("x", self.x, 16)?;
        check_align("out", self.out, 16)?;
        Ok(())
    }
}

/// `out[r, c] = silu(x[r, c]) · x[r, inter + c]` (see [`SiluMul`]) in one launch, each step
/// rounded as torch's `silu` and `mul` round it: `g / (1 + exp(-g))` in fp32, rounded to the
/// activation type, then its fp32 product with up, rounded to the activation type.
///
/// # Safety
/// See the module documentation.
pub unsafe fn silu_mul(a: &SiluMul, s: Stream) -> Result<()> {
    a.validate()?;
    let dev = dev_of(s)?;
    let f = dev.function("silu_mul")?;
    let (mut px, mut po) = (a.x, a.out);
    let (mut rows, mut inter, mut bf) =
        (a.rows as i64, a.inter as i32, (a.act == DType::Bf16) as i32);
    let mut p = args!(px, rows, inter, bf, po);
    let grid = (blocks(a.rows * a.inter / 8, 256)?, 1, 1);
    // SAFETY: parameter list matches silu_mul; buffers per SiluMul's contract.
    unsafe { launch(dev, f, grid, (256, 1, 1), 0, s.handle, &mut p) }
}

/// Smallest output count the split-K reduction sums four at a time.
const REDUCE_VEC_MIN: usize = 1 << 16;

/// Runs a split-K launch: `partials(ws)` writes `splits` fp32 partial outputs of `mn`
/// elements into `ws`, then the reduction kernel sums them in split order into `y`. The
/// workspace is the caller's (`workspace`: pointer, bytes), or 0 to allocate it
/// stream-ordered on `s`.
///
/// # Safety
/// `y` holds `mn` outputs; a given workspace is device memory of the bytes stated.
#[allow(clippy::too_many_arguments)]
unsafe fn split_k(
    dev: &Device,
    reduce: Option<Func>,
    splits: usize,
    mn: usize,
    y: u64,
    workspace: (u64, usize),
    s: Stream,
    partials: &mut dyn FnMut(u64) -> Result<()>,
) -> Result<()> {
    let (workspace, workspace_bytes) = workspace;
    let need = splits * mn * 4;
    let stream = s.handle as sys::CUstream;
    let (ws, owned) = if workspace != 0 {
        if workspace_bytes < need {
            return Err(CudaError::arg(
                "workspace_bytes",
                format!("at least {need}"),
                workspace_bytes,
            ));
        }
        check_align("workspace", workspace, 16)?;
        (workspace, false)
    } else {
        dev.bind()?;
        // SAFETY: stream-ordered allocation on the caller's stream, freed below on it.
        (
            unsafe { dr::malloc_async(stream, need) }.drv("cuMemAllocAsync")?,
            true,
        )
    };
    let res = (|| {
        partials(ws)?;
        let fr = reduce.ok_or_else(|| CudaError::MissingKernel("w4a16_reduce".into()))?;
        // Four outputs a thread for large outputs (cuda/gemm.cu `w4a16_reduce_impl`): measured
        // faster at 2^18 and more (M=128 GEMMs), slower at 2048 (M=1, K split ~60 ways).
        let vec = mn.is_multiple_of(4) && mn >= REDUCE_VEC_MIN;
        let threads = if vec { mn / 4 } else { mn };
        let (mut pws, mut py, mut sp, mut n, mut v) = (ws, y, splits as i32, mn as i64, vec as i32);
        let mut p = args!(pws, py, sp, n, v);
        let dims = ((blocks(threads, 256)?, 1, 1), (256, 1, 1), 0);
        // Launched programmatically (Hopper): scheduled while the partials' last blocks still
        // run, it waits for them in the kernel (`pdl_wait`).
        // SAFETY: ws holds splits·mn floats, y mn outputs; w4a16_reduce_* calls pdl_wait first.
        unsafe { launch_programmatic(dev, fr, dims, s.handle, &mut p) }
    })();
    if owned {
        // SAFETY: allocated above on this stream.
        unsafe { dr::free_async(ws, stream) }.drv("cuMemFreeAsync")?;
    }
    res
}

// ---------------------------------------------------------------------------------------
// (d) Hessian

/// Which Hessian kernel a launch runs (cuda/hessian.cu).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HessianKernel {
    /// The fastest one the device and inputs allow.
    #[default]
    Auto,
    /// fp32 SIMT (`hessian_accum_<dt>`): any dtype and D.
    Simt,
    /// mma.sync tensor cores (`hessian_tc_<dt>`): 16-bit inputs, D % 8 == 0, 16-byte aligned x.
    MmaSync,
    /// Hopper warpgroup MMA (`hessian_wg_<dt>`): as `MmaSync`, on compute capability 9.0 only,
    /// with `h` 16-byte aligned.
    Wgmma,
}

/// Which rows of `x` a Hessian update sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HessianRows {
    /// Rows `0..t` into one `H[D, D]`.
    All {
        /// Rows of `x`.
        t: usize,
    },
    /// Routed experts: for expert `e` in `0..experts`, the rows `idx[offsets[e] ..
    /// offsets[e+1]]` (i32 row indices, each `<` the rows of `x`; `offsets` i32
    /// `[experts + 1]`, 4-byte aligned) into `H_e = h + e·D·D` floats.
    Routed {
        /// i32 row indices.
        idx: u64,
        /// i32 `[experts + 1]` segment starts.
        offsets: u64,
        /// Number of experts (Hessians).
        experts: usize,
    },
}

/// Arguments of [`hessian_update`]: `H += alpha · XᵀX` in fp32 (products of 16-bit inputs
/// are exact in fp32; only the order of the sums differs between kernels), keeping `H`
/// exactly symmetric when it starts symmetric.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HessianUpdate {
    /// `x[T, D]` of `dtype` (F32, F16 or Bf16), row-major.
    pub x: u64,
    /// Element type of `x`.
    pub dtype: DType,
    /// Columns of `x` (the Hessian's side): positive.
    pub d: usize,
    /// The rows summed.
    pub rows: HessianRows,
    /// f32 `H[D, D]` (or `[experts, D, D]`), 4-byte aligned, updated in place.
    pub h: u64,
    /// Scale of the added product.
    pub alpha: f32,
    /// `H = alpha · XᵀX` instead of `+=`: every element of `H` written once (an expert
    /// without rows zeroed) and never read, as a fresh product.
    pub overwrite: bool,
    /// The kernel (tests and benches pick one; the run uses `Auto`).
    pub kernel: HessianKernel,
}

/// The kernel [`HessianKernel::Auto`] runs for `x` of `dtype` with `d` columns at address `x`
/// and `H` at `h` on a device of compute capability `cc`: tensor cores take 16-bit rows that
/// split into aligned 16-byte chunks (cuda/hessian.cu); the Hopper kernel also adds H's rows by
/// 16-byte bulk reductions.
fn hessian_auto_kernel(dtype: DType, d: usize, x: u64, h: u64, cc: (i32, i32)) -> HessianKernel {
    let tc =
        matches!(dtype, DType::F16 | DType::Bf16) && d.is_multiple_of(8) && x.is_multiple_of(16);
    if !tc {
        HessianKernel::Simt
    } else if cc == (9, 0) && h.is_multiple_of(16) {
        HessianKernel::Wgmma
    } else {
        HessianKernel::MmaSync
    }
}

/// The kernel [`hessian_update`] with [`HessianKernel::Auto`] runs for these inputs on the
/// stream's device (callers choosing between it and another library's product).
pub fn hessian_kernel(dtype: DType, d: usize, x: u64, h: u64, s: Stream) -> Result<HessianKernel> {
    Ok(hessian_auto_kernel(dtype, d, x, h, dev_of(s)?.cc))
}

/// `H += alpha · XᵀX`, or `H = alpha · XᵀX` with `overwrite` (see [`HessianUpdate`]). A
/// kernel the inputs or the device do not allow is an argument error.
///
/// # Safety
/// See the module documentation; every routed index must be a row of `x`.
pub unsafe fn hessian_update(a: &HessianUpdate, s: Stream) -> Result<()> {
    if a.dtype == DType::F8E4M3 {
        return Err(CudaError::arg("dtype", "F32, F16 or Bf16", "F8E4M3"));
    }
    check_nonzero("d", a.d)?;
    check_align("x", a.x, a.dtype.size() as u64)?;
    check_align("h", a.h, 4)?;
    let (t, idx, offsets, experts) = match a.rows {
        HessianRows::All { t } => (t, 0, 0, 1),
        HessianRows::Routed {
            idx,
            offsets,
            experts,
        } => {
            check_align("idx", idx, 4)?;
            check_align("offsets", offsets, 4)?;
            check_nonzero("experts", experts)?;
            (0, idx, offsets, experts)
        }
    };
    let dev = dev_of(s)?;
    let auto = hessian_auto_kernel(a.dtype, a.d, a.x, a.h, dev.cc);
    let (tc, wg_ok) = (auto != HessianKernel::Simt, auto == HessianKernel::Wgmma);
    let kernel = match a.kernel {
        HessianKernel::Auto => auto,
        HessianKernel::MmaSync | HessianKernel::Wgmma if !tc => {
            return Err(CudaError::arg(
                "kernel",
                "16-bit x, 16-byte aligned, with D a multiple of 8",
                format!("{:?}, D = {}", a.dtype, a.d),
            ))
        }
        HessianKernel::Wgmma if !wg_ok => {
            return Err(CudaError::arg(
                "kernel",
                "compute capability 9.0 and a 16-byte aligned h for Wgmma",
                format!("{:?}, h at {:#x}", dev.cc, a.h),
            ))
        }
        k => k,
    };
    let (name, tiles, smem, threads) = match kernel {
        HessianKernel::Wgmma => ("hessian_wg", hessian_wg_tiles(a.d), HESSIAN_WG_SMEM, 384),
        HessianKernel::MmaSync => ("hessian_tc", upper_tiles(a.d, 128), HESSIAN_TC_SMEM, 256),
        _ => ("hessian_accum", upper_tiles(a.d, 64), 0, 256),
    };
    let f = dev.function(kname(name, a.dtype)?)?;
    let (mut px, mut ph, mut pi, mut po) = (a.x, a.h, idx, offsets);
    let (mut tt, mut dd, mut al) = (to_i32("t", t)?, to_i32("d", a.d)?, a.alpha);
    let mut ow = i32::from(a.overwrite);
    let mut p = args!(px, ph, pi, po, tt, dd, al, ow);
    let grid = (
        to_i32("tiles", tiles)? as u32,
        to_i32("experts", experts)? as u32,
        1,
    );
    // SAFETY: parameter list matches hessian_accum_<dt>, hessian_tc_<dt> and hessian_wg_<dt>
    // (256 threads, 384 for hessian_wg's three warpgroups).
    unsafe { launch(dev, f, grid, (threads, 1, 1), smem, s.handle, &mut p) }
}

/// Shared memory of `hessian_tc_<dt>`: 4 stages of two 32 × 128 16-bit tiles, reused by
/// the epilogue's 128 × 129 fp32 tile (the larger of the two).
pub(crate) const HESSIAN_TC_SMEM: u32 = 128 * 129 * 4;

/// Shared memory of `hessian_wg_<dt>` (Hopper): 4 stages of 64 rows × (128 + 256) 16-bit
/// features (more than the adding epilogue's five fp32 staging buffers of 128 × 72, which reuse
/// them) and their 8 mbarriers, plus 1 KB to start them on a 1024-byte boundary (where the
/// MMA's 128-byte swizzle pattern repeats).
pub(crate) const HESSIAN_WG_SMEM: u32 = 4 * 64 * (128 + 256) * 2 + 8 * 8 + 1024;

/// Tiles of `tile × tile` on or above the diagonal of a `d × d` Hessian (`hessian_accum` and
/// `hessian_tc` blocks).
fn upper_tiles(d: usize, tile: usize) -> usize {
    let nb = d.div_ceil(tile);
    nb * (nb + 1) / 2
}

/// Blocks of `hessian_wg`: the 128 × 256 tiles `(bi, bj)` with `bj >= bi / 2`, those holding
/// an element on or above the diagonal (cuda/hessian.cu `hw_tile`).
fn hessian_wg_tiles(d: usize) -> usize {
    let nbj = d.div_ceil(256);
    (0..d.div_ceil(128)).map(|bi| nbj - bi / 2).sum()
}

// ---------------------------------------------------------------------------------------
// (e) GPTQ

/// Largest GPTQ block size the CUDA solver supports.
pub const GPTQ_MAX_BLOCK: usize = 128;

/// Columns per super-block of [`gptq_solve`] (rounded down to a multiple of the block size).
pub const GPTQ_SUPER_BLOCK: usize = 512;

/// The super-block of `block_size` columns: the largest multiple of it up to
/// [`GPTQ_SUPER_BLOCK`], so that the blocks are the CPU solver's.
fn gptq_super(block_size: usize) -> usize {
    (GPTQ_SUPER_BLOCK / block_size).max(1) * block_size
}

/// Bytes of the error workspace [`gptq_solve`] needs for `experts` matrices of `c × r`
/// (`weight_t`) at `block_size`: one super-block's scaled errors, `min(super, c) · r` floats
/// per matrix.
pub fn gptq_workspace_bytes(experts: usize, c: usize, r: usize, block_size: usize) -> usize {
    experts * gptq_super(block_size.clamp(1, GPTQ_MAX_BLOCK)).min(c) * r * 4
}

/// Arguments of [`gptq_solve`]: blocked GPTQ (docs/numerics.md) on `experts` matrices of one
/// shape `C × R` (`weight_t`), in place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptqSolve {
    /// f32 `[E, C, R]` (`weight_t`), updated: quantized rows hold x̂ on return.
    pub w: u64,
    /// f32 `[E, C, C]`: the upper Cholesky factor of H⁻¹, in processing order.
    pub u: u64,
    /// u32 `[E, R, ceil(C/G)]`: each output row's grid words.
    pub qmeta: u64,
    /// i32 `[E, C]`: the processing order (activation order), or 0 for the natural order.
    pub perm: u64,
    /// u8 `[E, C, R]`: the codes, written in the original order.
    pub codes: u64,
    /// f32 workspace of [`gptq_workspace_bytes`] for these dimensions.
    pub err_ws: u64,
    /// Matrices `E`.
    pub experts: usize,
    /// Inputs `C` (the rows of `weight_t`, quantized in order).
    pub c: usize,
    /// Outputs `R`.
    pub r: usize,
    /// The grid's bits and group size (along `C`).
    pub spec: GridSpec,
    /// Columns quantized together before their errors update the rest: 1..=128.
    pub block_size: usize,
}

impl GptqSolve {
    /// Every argument checked before the driver is touched.
    pub fn validate(&self) -> Result<()> {
        check_spec(&self.spec)?;
        check_nonzero("experts", self.experts)?;
        check_nonzero("c", self.c)?;
        check_nonzero("r", self.r)?;
        to_i32("experts", self.experts)?;
        to_i32("c", self.c)?;
        to_i32("r", self.r)?;
        if self.block_size == 0 || self.block_size > GPTQ_MAX_BLOCK {
            return Err(CudaError::arg("block_size", "1..=128", self.block_size));
        }
        for (name, p) in [
            ("w", self.w),
            ("u", self.u),
            ("qmeta", self.qmeta),
            ("codes", self.codes),
            ("err_ws", self.err_ws),
        ] {
            check_align(name, p, 1)?;
        }
        Ok(())
    }
}

/// Blocked GPTQ on `experts` matrices of one shape, in place (see [`GptqSolve`]).
///
/// The trailing updates are lazy at two levels: a block's errors update only the rest of its
/// super-block (about 4 blocks); a super-block's errors then update all later rows in one
/// product of depth `super`, so each later row of W is read and written once per super-block
/// instead of once per block (the same products, summed in another order).
///
/// # Safety
/// See the module documentation.
pub unsafe fn gptq_solve(a: &GptqSolve, s: Stream) -> Result<()> {
    a.validate()?;
    let GptqSolve {
        w,
        u,
        qmeta,
        perm,
        codes,
        err_ws,
        experts,
        c,
        r,
        spec,
        block_size,
    } = *a;
    let dev = dev_of(s)?;
    let fb = dev.function("gptq_block_f32")?;
    let ft = dev.function("gptq_trail_tf32x3")?;
    let aligned =
        [u, err_ws, w].iter().all(|&p| p % 16 == 0) && c.is_multiple_of(4) && r.is_multiple_of(4);
    // validate() bounded experts, c and r by i32, and the error rows are at most c.
    let (ee, ci, ri) = (experts as u32, c as i32, r as i32);
    let sup = gptq_super(block_size);
    let err_rows = sup.min(c) as i32;
    // W[row0..row1] -= U[k0..k0+kn, row0..row1]ᵀ · Err[0..kn], Err starting at column k0's row.
    let trail = |k0: usize, kn: usize, row0: usize, row1: usize, err: u64| -> Result<()> {
        let (mut pw, mut pu, mut pe, mut pp) = (w, u, err, perm);
        let (mut cc, mut rr, mut er) = (ci, ri, err_rows);
        let (mut k0i, mut kni) = (k0 as i32, kn as i32);
        let (mut r0, mut r1) = (row0 as i32, row1 as i32);
        let mut vec = (aligned && row0.is_multiple_of(4) && row1.is_multiple_of(4)) as i32;
        let grid = (blocks(r, 128)?, blocks(row1 - row0, 128)?, ee);
        let mut p = args!(pw, pu, pe, pp, cc, rr, k0i, kni, r0, r1, er, vec);
        // SAFETY: parameter list matches gptq_trail_tf32x3.
        unsafe { launch(dev, ft, grid, (256, 1, 1), 0, s.handle, &mut p) }
    };
    let mut s1 = 0usize;
    while s1 < c {
        let s2 = (s1 + sup).min(c);
        let mut i1 = s1;
        while i1 < s2 {
            let bsz = block_size.min(s2 - i1);
            let err = err_ws + ((i1 - s1) * r * 4) as u64;
            let (mut pw, mut pu, mut pq, mut pp, mut pc, mut pe) = (w, u, qmeta, perm, codes, err);
            let (mut cc, mut rr, mut g, mut bits, mut ii, mut bb, mut er) = (
                ci,
                ri,
                spec.group_size as i32,
                spec.bits as i32,
                i1 as i32,
                bsz as i32,
                err_rows,
            );
            let mut p = args!(pw, pu, pq, pp, pc, pe, cc, rr, g, bits, ii, bb, er);
            // SAFETY: parameter list matches gptq_block_f32.
            unsafe {
                launch(
                    dev,
                    fb,
                    (blocks(r, 64)?, ee, 1),
                    (64, 1, 1),
                    0,
                    s.handle,
                    &mut p,
                )?
            };
            let i2 = i1 + bsz;
            if i2 < s2 {
                trail(i1, bsz, i2, s2, err)?;
            }
            i1 = i2;
        }
        if s2 < c {
            trail(s1, s2 - s1, s2, c, err_ws)?;
        }
        s1 = s2;
    }
    Ok(())
}

/// Compiles and loads every kernel module on `device` (GPU self-test of the sources).
pub fn compile_all(device_ordinal: usize) -> Result<()> {
    device(device_ordinal)?.load_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tiled_warps_picks() {
        // An H200 (132 SMs), G = 128 (2 chunks a group). The M <= 8 kernel: 64 registers, 32
        // warps an SM; each pick below was within 1 % of the fastest of 4 to 32 warps measured
        // at M = 1 (LOG.md, "Warps a block, swept").
        let m1 = |tiles: usize, groups: usize| tiled_warps(132, tiles, groups, 2, 32, |w| 32 / w);
        // 7168x18432 (1152 tiles of 56 groups): 8 warps (25.1 µs; 2.2 rounds of 528 blocks, 7
        // groups a warp), not whole waves' 6 (26.6: 10 groups for the busiest warp) nor 4
        // (28.6: 1.1 rounds of 1056 blocks, then a tail of 14-group blocks).
        assert_eq!(m1(1152, 56), 8);
        // 2048x7168 (448 tiles of 16 groups): 4 warps of 4 groups (5.44 µs), not 8 of 2 (5.96).
        assert_eq!(m1(448, 16), 4);
        // 16384x7168, 18432x7168 (448 tiles of 128, 144 groups): 8 warps.
        assert_eq!(m1(448, 128), 8);
        assert_eq!(m1(448, 144), 8);
        // 7168x4096 (256 tiles): 14 warps of 4 groups; 1536x24576, 512x32768: 4 warps.
        assert_eq!(m1(256, 56), 14);
        assert_eq!(m1(1536, 12), 4);
        assert_eq!(m1(2048, 4), 4);
        // Fewer tiles than SMs (7168x2048, 7168x1536, 7168x576): a tile's groups over a whole
        // SM, 2 a warp (28 warps), whatever the chunks.
        assert_eq!(m1(128, 56), 28);
        assert_eq!(m1(96, 56), 28);
        assert_eq!(m1(36, 56), 28);
        assert_eq!(m1(128, 64), 32);
        // G = 64 (1 chunk a group): 2048x7168's 32 groups still make 8-chunk warps.
        assert_eq!(tiled_warps(132, 448, 32, 1, 32, |w| 32 / w), 4);
        // The M > 8 kernel (82 registers: 20 warps an SM, at most 16 a block).
        let m16 = |tiles: usize, groups: usize| tiled_warps(132, tiles, groups, 2, 16, |w| 20 / w);
        assert_eq!(m16(1152, 56), 4);
        assert_eq!(m16(448, 144), 5);
        assert_eq!(m16(128, 56), 14);
        // Fewer groups than warps: no warp without a group past the fewest (4).
        assert_eq!(m1(8, 2), 4);
        assert_eq!(m1(8, 6), 6);
        // An SM that holds one block whatever its size: the most warps, fewest groups each.
        assert_eq!(tiled_warps(132, 132, 64, 2, 16, |_| 1), 16);
    }

    #[test]
    fn range_grid_kernel_choice() {
        use RangeKernel::{Lanes, Octets, PerGroup};
        // The range kernel of a (dtype, x address, cols, group size, block scales) grid.
        let kernel =
            |dtype: DType, x: u64, cols: usize, group_size: usize, bs: u64, cc: (i32, i32)| {
                let spec = GridSpec {
                    bits: 4,
                    group_size,
                    symmetric: false,
                };
                let g = QmetaGrid {
                    x,
                    dtype,
                    rows: 4,
                    cols,
                    spec,
                    qmeta: 0,
                    block_scale: bs,
                };
                range_kernel(&g, cc)
            };
        let hopper = (9, 0);
        // Whole 16-byte units: 4 f32, 8 f16 / bf16, 16 E4M3 elements.
        for (dt, per) in [
            (DType::F32, 4usize),
            (DType::F16, 8),
            (DType::Bf16, 8),
            (DType::F8E4M3, 16),
        ] {
            // Every group whole and 128 bytes (8 units), or 256 bytes without block scales.
            assert_eq!(kernel(dt, 4096, 4096, 8 * per, 0, hopper), Octets, "{dt:?}");
            assert_eq!(
                kernel(dt, 4096, 4096, 8 * per, 4096, hopper),
                Octets,
                "{dt:?}"
            );
            assert_eq!(
                kernel(dt, 4096, 4096, 16 * per, 0, hopper),
                Octets,
                "{dt:?}"
            );
            assert_eq!(
                kernel(dt, 4096, 4096, 16 * per, 4096, hopper),
                PerGroup,
                "{dt:?}"
            );
            // A padded last group (704 = 5.5 groups of 128), or groups of 2 units.
            assert_eq!(kernel(dt, 4096, 704, 128, 0, hopper), PerGroup, "{dt:?}");
            assert_eq!(
                kernel(dt, 4096, 32 * per, 2 * per, 0, hopper),
                PerGroup,
                "{dt:?}"
            );
            // A misaligned x, columns or groups not whole units: the lane-per-8 kernel.
            assert_eq!(
                kernel(dt, 4096 + 8, 4096, 8 * per, 0, hopper),
                Lanes,
                "{dt:?}"
            );
            assert_eq!(
                kernel(dt, 4096, 704 + per / 2, 128, 0, hopper),
                Lanes,
                "{dt:?}"
            );
            assert_eq!(
                kernel(dt, 4096, 704, 8 * per + per / 2, 0, hopper),
                Lanes,
                "{dt:?}"
            );
        }
        // E4M3 needs the pairwise hardware conversion (sm_89+); the other types do not.
        assert_eq!(kernel(DType::F8E4M3, 4096, 4096, 128, 0, (8, 0)), Lanes);
        assert_eq!(kernel(DType::F8E4M3, 4096, 4096, 128, 0, (8, 9)), Octets);
        assert_eq!(kernel(DType::Bf16, 4096, 704, 128, 0, (8, 0)), PerGroup);
    }

    /// Which kernel runs the grouped tensor-core form, by device and shape (no GPU needed).
    #[test]
    fn grouped_tc_form_by_device_and_shape() {
        use GroupedForm::{Mma, Wgmma};
        // FORGE_GEMM_WG=0 sends sm_90 to mma.sync too
        let hopper = if knobs().wgmma_off { Mma } else { Wgmma };
        // DeepSeek-V3's experts (gate_up 7168 -> 4096, down 2048 -> 7168, G = 128)
        for (n, k) in [(4096, 7168), (7168, 2048)] {
            assert_eq!(grouped_tc_form((9, 0), n, k, 128), Some(hopper));
            for cc in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)] {
                assert_eq!(grouped_tc_form(cc, n, k, 128), Some(Mma), "{cc:?}");
            }
            assert_eq!(grouped_tc_form((7, 5), n, k, 128), None);
        }
        // Shapes the wgmma kernel does not take run mma.sync on sm_90 too: N % 128, G = 32,
        // K % 64 (with G = 96).
        assert_eq!(grouped_tc_form((9, 0), 352, 512, 32), Some(Mma));
        assert_eq!(grouped_tc_form((9, 0), 512, 512, 32), Some(Mma));
        assert_eq!(grouped_tc_form((9, 0), 512, 288, 96), Some(Mma));
        // Neither: N % 32, G % 32, K not whole groups, an empty shape.
        for (n, k, g) in [
            (40, 512, 128),
            (512, 576, 48),
            (512, 200, 128),
            (512, 0, 128),
            (512, 512, 0),
        ] {
            assert_eq!(grouped_tc_form((9, 0), n, k, g), None, "({n}, {k}, {g})");
            assert_eq!(grouped_tc_form((8, 0), n, k, g), None, "({n}, {k}, {g})");
        }
        assert_eq!(tc_max_rows(Some(Wgmma)), 256);
        assert_eq!(tc_max_rows(Some(Mma)), GROUPED_MMA_MAX_ROWS);
        assert_eq!(tc_max_rows(None), 0);
    }

    #[test]
    fn grouped_plan_shapes() {
        for (rows, segs, n, k) in [
            (1usize, 6usize, 2816usize, 2048usize),
            (1, 6, 2048, 1408),
            (2, 80, 2816, 2048),
            (4, 113, 2048, 1408),
            (4, 1, 256, 128),
            (1, 8, 36864, 7168),
        ] {
            let p = grouped_plan(132 * 2, rows, segs, n, k);
            assert!(
                p.k_chunk.is_multiple_of(8 * GEMV3_WARPS)
                    && p.splits * p.k_chunk >= k
                    && (p.splits - 1) * p.k_chunk < k,
                "{p:?}"
            );
            assert!(p.nblocks * grouped_block_n(rows) >= n, "{p:?}");
            assert!((p.nblocks - 1) * grouped_block_n(rows) < n, "{p:?}");
        }
        // A decode step fills the GPU by splitting K; a big table does not split.
        assert!(grouped_plan(132 * 2, 1, 6, 2816, 2048).splits > 1);
        assert_eq!(grouped_plan(132 * 2, 2, 512, 2816, 2048).splits, 1);
    }

    fn grouped_args() -> GroupedGemv {
        let (k, n, g) = (256, 512, 128);
        GroupedGemv {
            x: 256,
            act: DType::Bf16,
            x_rows: 256,
            out_rows: 256,
            pairs: 6,
            segments: 256,
            num_segments: 6,
            rows: 1,
            experts: 8,
            k,
            n,
            group_size: g,
            qweight: 256,
            qzeros: 256,
            scales: 256,
            expert_strides: GroupedGemv::dense_strides(k, n, g),
            y: 256,
            workspace: 0,
            workspace_bytes: 0,
        }
    }

    #[test]
    fn grouped_args_are_validated_before_the_driver() {
        assert!(grouped_args().validate().is_ok());
        let bad = |a: GroupedGemv| refused(a.validate());
        let a = grouped_args();
        assert_eq!(bad(GroupedGemv { rows: 3, ..a }), "rows");
        assert_eq!(bad(GroupedGemv { n: 40, ..a }), "n");
        assert_eq!(
            bad(GroupedGemv {
                group_size: 96,
                ..a
            }),
            "group_size"
        );
        assert_eq!(bad(GroupedGemv { k: 200, ..a }), "k");
        assert_eq!(bad(GroupedGemv { pairs: 0, ..a }), "pairs");
        assert_eq!(
            bad(GroupedGemv {
                num_segments: 0,
                ..a
            }),
            "num_segments"
        );
        assert_eq!(
            bad(GroupedGemv {
                num_segments: 70000,
                ..a
            }),
            "num_segments"
        );
        assert_eq!(
            bad(GroupedGemv {
                act: DType::F32,
                ..a
            }),
            "act"
        );
        assert_eq!(bad(GroupedGemv { x: 258, ..a }), "x");
        assert_eq!(bad(GroupedGemv { segments: 0, ..a }), "segments");
        let mut st = a.expert_strides;
        st[2] += 4; // scales of the next expert no longer 16-byte aligned
        assert_eq!(
            bad(GroupedGemv {
                expert_strides: st,
                ..a
            }),
            "expert_strides[2] (scales)"
        );
        let mut st = a.expert_strides;
        st[0] -= 4; // experts would overlap
        assert_eq!(
            bad(GroupedGemv {
                expert_strides: st,
                ..a
            }),
            "expert_strides[0] (qweight)"
        );
        // The tensor-core rows: up to 64 rows N and G % 32 (the mma.sync kernel), 128 rows
        // N % 128, K and G % 64 (the wgmma kernel); G need not be a power of two, and every
        // expert's zero points on a 16-byte boundary.
        let wg = GroupedGemv { rows: 64, ..a };
        assert!(wg.validate().is_ok());
        let t128 = GroupedGemv { rows: 128, ..a };
        assert!(t128.validate().is_ok());
        // `base` with experts of (k, n, g), densely stacked.
        let reshaped = |base: GroupedGemv, (k, n, g): (usize, usize, usize)| GroupedGemv {
            k,
            n,
            group_size: g,
            expert_strides: GroupedGemv::dense_strides(k, n, g),
            ..base
        };
        let mma = reshaped(wg, (288, 448, 96));
        assert!(mma.validate().is_ok());
        assert_eq!(bad(GroupedGemv { rows: 128, ..mma }), "(n, k, group_size)");
        assert_eq!(bad(GroupedGemv { n: 448, ..t128 }), "(n, k, group_size)");
        assert_eq!(bad(GroupedGemv { n: 40, ..wg }), "n");
        let wg192 = reshaped(wg, (576, 384, 192));
        assert!(wg192.validate().is_ok());
        assert!(GroupedGemv { rows: 128, ..wg192 }.validate().is_ok());
        assert_eq!(bad(GroupedGemv { k: 288, ..wg }), "k");
        assert_eq!(bad(GroupedGemv { qzeros: 260, ..wg }), "qzeros");
        let mut st = wg.expert_strides;
        st[1] += 2; // the next expert's zero points off a 16-byte boundary
        assert_eq!(
            bad(GroupedGemv {
                expert_strides: st,
                ..wg
            }),
            "expert_strides[1] (qzeros)"
        );
        assert_eq!(bad(GroupedGemv { rows: 8, ..a }), "rows");
        // The launch itself rejects them too, whatever the machine.
        let r = unsafe { w4a16_grouped_gemv_awq(&GroupedGemv { rows: 3, ..a }, Stream::default()) };
        assert!(matches!(
            r,
            Err(CudaError::InvalidArgument { name: "rows", .. })
        ));
    }

    /// The argument an `InvalidArgument` error names (any other outcome fails the test).
    fn refused(r: Result<()>) -> &'static str {
        match r {
            Err(CudaError::InvalidArgument { name, .. }) => name,
            other => panic!("expected an invalid argument, got {other:?}"),
        }
    }

    fn spec(bits: u8, group_size: usize) -> GridSpec {
        GridSpec {
            bits,
            group_size,
            symmetric: false,
        }
    }

    #[test]
    fn silu_mul_args_are_validated_before_the_driver() {
        let a = SiluMul {
            x: 256,
            act: DType::Bf16,
            rows: 3,
            inter: 1408,
            out: 512,
        };
        assert!(a.validate().is_ok());
        assert_eq!(
            refused(
                SiluMul {
                    act: DType::F32,
                    ..a
                }
                .validate()
            ),
            "act"
        );
        assert_eq!(refused(SiluMul { rows: 0, ..a }.validate()), "rows");
        assert_eq!(refused(SiluMul { inter: 0, ..a }.validate()), "inter");
        assert_eq!(refused(SiluMul { inter: 12, ..a }.validate()), "inter");
        assert_eq!(
            refused(
                SiluMul {
                    inter: 1 << 30,
                    ..a
                }
                .validate()
            ),
            "2·inter"
        );
        assert_eq!(refused(SiluMul { rows: 1 << 40, ..a }.validate()), "grid");
        assert_eq!(
            refused(
                SiluMul {
                    rows: usize::MAX,
                    ..a
                }
                .validate()
            ),
            "rows"
        );
        assert_eq!(refused(SiluMul { x: 0, ..a }.validate()), "x");
        assert_eq!(refused(SiluMul { x: 264, ..a }.validate()), "x");
        assert_eq!(refused(SiluMul { out: 8, ..a }.validate()), "out");
    }

    #[test]
    fn grid_args_are_validated_before_the_driver() {
        let a = QmetaGrid {
            x: 256,
            dtype: DType::F32,
            rows: 16,
            cols: 300,
            spec: spec(4, 128),
            qmeta: 256,
            block_scale: 0,
        };
        assert!(a.validate().is_ok());
        assert_eq!(refused(QmetaGrid { rows: 0, ..a }.validate()), "rows");
        assert_eq!(refused(QmetaGrid { cols: 0, ..a }.validate()), "cols");
        assert_eq!(refused(QmetaGrid { cols: 1 << 31, ..a }.validate()), "cols");
        assert_eq!(
            refused(
                QmetaGrid {
                    spec: spec(4, 100),
                    ..a
                }
                .validate()
            ),
            "spec"
        );
        assert_eq!(refused(QmetaGrid { x: 258, ..a }.validate()), "x");
        let bf16_at_2 = QmetaGrid {
            dtype: DType::Bf16,
            x: 258,
            ..a
        };
        assert!(bf16_at_2.validate().is_ok());
        assert_eq!(refused(QmetaGrid { qmeta: 0, ..a }.validate()), "qmeta");
        // FP8 block scales: only with an F8_E4M3 weight, 4-byte aligned.
        assert_eq!(
            refused(
                QmetaGrid {
                    block_scale: 512,
                    ..a
                }
                .validate()
            ),
            "block_scale"
        );
        let fp8 = QmetaGrid {
            dtype: DType::F8E4M3,
            block_scale: 512,
            ..a
        };
        assert!(fp8.validate().is_ok());
        assert_eq!(
            refused(
                QmetaGrid {
                    block_scale: 514,
                    ..fp8
                }
                .validate()
            ),
            "block_scale"
        );
        // The launches refuse them too, whatever the machine; the MSE spec is checked
        // before the driver as well.
        let s = Stream::default();
        unsafe {
            assert_eq!(refused(qmeta_range(&QmetaGrid { rows: 0, ..a }, s)), "rows");
            let mse = MseSpec::default();
            assert_eq!(refused(qmeta_mse(&QmetaGrid { x: 0, ..a }, &mse, s)), "x");
            let no_grid = MseSpec { n_grid: 0, ..mse };
            assert_eq!(refused(qmeta_mse(&a, &no_grid, s)), "mse");
        }
    }

    fn packed_out() -> PackedOut {
        PackedOut {
            qweight: 256,
            qzeros: 256,
            scales: 256,
        }
    }

    fn quantize_pack_args() -> QuantizePack {
        QuantizePack {
            w: 256,
            dtype: DType::Bf16,
            n: 512,
            k: 256,
            qmeta: 256,
            spec: spec(4, 128),
            block_scale: 0,
        }
    }

    fn pack_codes_args() -> PackCodes {
        PackCodes {
            codes: 256,
            qmeta: 256,
            n: 512,
            k: 256,
            spec: spec(4, 128),
        }
    }

    #[test]
    fn gptq_solve_args_are_validated_before_the_driver() {
        let a = GptqSolve {
            w: 256,
            u: 512,
            qmeta: 768,
            perm: 0,
            codes: 1024,
            err_ws: 1280,
            experts: 2,
            c: 256,
            r: 64,
            spec: spec(4, 128),
            block_size: 128,
        };
        assert!(a.validate().is_ok());
        assert!(GptqSolve { perm: 2048, ..a }.validate().is_ok());
        assert_eq!(refused(GptqSolve { experts: 0, ..a }.validate()), "experts");
        assert_eq!(refused(GptqSolve { c: 0, ..a }.validate()), "c");
        assert_eq!(refused(GptqSolve { r: 1 << 31, ..a }.validate()), "r");
        assert_eq!(
            refused(GptqSolve { block_size: 0, ..a }.validate()),
            "block_size"
        );
        assert_eq!(
            refused(
                GptqSolve {
                    block_size: 129,
                    ..a
                }
                .validate()
            ),
            "block_size"
        );
        assert_eq!(
            refused(
                GptqSolve {
                    spec: spec(4, 100),
                    ..a
                }
                .validate()
            ),
            "spec"
        );
        for (name, bad) in [
            ("w", GptqSolve { w: 0, ..a }),
            ("u", GptqSolve { u: 0, ..a }),
            ("qmeta", GptqSolve { qmeta: 0, ..a }),
            ("codes", GptqSolve { codes: 0, ..a }),
            ("err_ws", GptqSolve { err_ws: 0, ..a }),
        ] {
            assert_eq!(refused(bad.validate()), name);
            // The launch refuses it too, whatever the machine.
            assert_eq!(
                refused(unsafe { gptq_solve(&bad, Stream::default()) }),
                name
            );
        }
    }

    #[test]
    fn pack_args_are_validated_before_the_driver() {
        let (a, c, out) = (quantize_pack_args(), pack_codes_args(), packed_out());
        assert!(a.validate().is_ok() && c.validate().is_ok() && out.validate().is_ok());
        let s = Stream::default();

        // Shapes and grid, the same for both inputs.
        assert_eq!(refused(QuantizePack { k: 200, ..a }.validate()), "k");
        assert_eq!(refused(PackCodes { k: 200, ..c }.validate()), "k");
        assert_eq!(refused(QuantizePack { k: 0, ..a }.validate()), "k");
        assert_eq!(refused(PackCodes { n: 0, ..c }.validate()), "n");
        assert_eq!(refused(QuantizePack { n: 12, ..a }.validate()), "n");
        assert_eq!(refused(PackCodes { n: 1 << 31, ..c }.validate()), "n");
        let three_bits = spec(3, 128);
        assert_eq!(
            refused(
                QuantizePack {
                    spec: three_bits,
                    ..a
                }
                .validate()
            ),
            "spec"
        );
        assert_eq!(
            refused(
                PackCodes {
                    spec: spec(4, 100),
                    ..c
                }
                .validate()
            ),
            "spec"
        );

        // Pointers.
        assert_eq!(refused(QuantizePack { w: 0, ..a }.validate()), "w");
        assert_eq!(refused(QuantizePack { w: 264, ..a }.validate()), "w");
        let f32_at_16 = QuantizePack {
            dtype: DType::F32,
            w: 272,
            ..a
        };
        assert_eq!(refused(f32_at_16.validate()), "w");
        assert_eq!(
            refused(QuantizePack { qmeta: 258, ..a }.validate()),
            "qmeta"
        );
        assert_eq!(refused(PackCodes { codes: 0, ..c }.validate()), "codes");
        assert_eq!(refused(PackCodes { qmeta: 0, ..c }.validate()), "qmeta");
        assert_eq!(
            refused(PackedOut { qweight: 0, ..out }.validate()),
            "qweight"
        );
        assert_eq!(
            refused(PackedOut { qzeros: 258, ..out }.validate()),
            "qzeros"
        );
        assert_eq!(
            refused(PackedOut { scales: 257, ..out }.validate()),
            "scales"
        );

        // The launches refuse them too, whatever the machine, and check what only they
        // need: 8-byte qweight stores of the fused kernel, 8-byte code loads of the AWQ
        // pack, an aligned flag for the GPTQ pack.
        unsafe {
            let bad_a = QuantizePack { k: 200, ..a };
            assert_eq!(refused(awq_quantize_pack(&bad_a, &out, s)), "k");
            let bad_out = PackedOut { scales: 0, ..out };
            assert_eq!(refused(awq_quantize_pack(&a, &bad_out, s)), "scales");
            let qweight_at_4 = PackedOut {
                qweight: 260,
                ..out
            };
            assert!(qweight_at_4.validate().is_ok());
            assert_eq!(refused(awq_quantize_pack(&a, &qweight_at_4, s)), "qweight");

            let bad_c = PackCodes { n: 0, ..c };
            assert_eq!(refused(awq_pack_codes(&bad_c, &out, s)), "n");
            assert_eq!(refused(gptq_pack_codes(&bad_c, &out, 0, s)), "n");
            assert_eq!(refused(awq_pack_codes(&c, &bad_out, s)), "scales");
            assert_eq!(refused(gptq_pack_codes(&c, &bad_out, 0, s)), "scales");
            let codes_at_1 = PackCodes { codes: 257, ..c };
            assert!(codes_at_1.validate().is_ok());
            assert_eq!(refused(awq_pack_codes(&codes_at_1, &out, s)), "codes");
            assert_eq!(refused(gptq_pack_codes(&c, &out, 258, s)), "bad_flag");
        }
    }

    /// The pack launches accept exactly the shapes the CPU packers accept.
    #[test]
    fn pack_shape_checks_match_forge_core() {
        for sp in [
            spec(4, 128),
            spec(4, 32),
            spec(3, 128),
            spec(4, 100),
            spec(8, 64),
        ] {
            for n in [0usize, 8, 12, 40, 512] {
                for k in [0usize, 32, 64, 128, 200, 256] {
                    let core = forge_core::pack::check_pack_shape(k, n, &sp).is_ok();
                    assert_eq!(check_pack_shape(n, k, &sp).is_ok(), core, "{sp:?} {n} {k}");
                }
            }
        }
    }

    fn gemm_args() -> W4a16Gemm {
        W4a16Gemm {
            x: 256,
            act: DType::F16,
            m: 4,
            n: 512,
            k: 256,
            group_size: 128,
            qweight: 256,
            qzeros: 256,
            scales: 256,
            y: 256,
            workspace: 0,
            workspace_bytes: 0,
        }
    }

    #[test]
    fn gemm_args_are_validated_before_the_driver() {
        let a = gemm_args();
        assert!(a.validate().is_ok());
        let bad = |b: W4a16Gemm| refused(b.validate());
        assert_eq!(
            bad(W4a16Gemm {
                act: DType::F32,
                ..a
            }),
            "act"
        );
        assert_eq!(bad(W4a16Gemm { m: 0, ..a }), "m");
        assert_eq!(bad(W4a16Gemm { group_size: 0, ..a }), "group_size");
        assert_eq!(
            bad(W4a16Gemm {
                group_size: 48,
                ..a
            }),
            "group_size"
        );
        assert_eq!(bad(W4a16Gemm { k: 0, ..a }), "k");
        assert_eq!(bad(W4a16Gemm { k: 320, ..a }), "k");
        assert_eq!(bad(W4a16Gemm { n: 0, ..a }), "n");
        assert_eq!(bad(W4a16Gemm { n: 40, ..a }), "n");
        assert_eq!(bad(W4a16Gemm { m: 1 << 31, ..a }), "m");
        assert_eq!(bad(W4a16Gemm { x: 0, ..a }), "x");
        assert_eq!(bad(W4a16Gemm { x: 264, ..a }), "x");
        assert_eq!(bad(W4a16Gemm { qweight: 264, ..a }), "qweight");
        assert_eq!(bad(W4a16Gemm { qzeros: 258, ..a }), "qzeros");
        // 4-byte aligned is not enough: the kernels copy it in 16-byte chunks.
        assert_eq!(bad(W4a16Gemm { qzeros: 260, ..a }), "qzeros");
        assert_eq!(bad(W4a16Gemm { scales: 264, ..a }), "scales");
        assert_eq!(bad(W4a16Gemm { y: 257, ..a }), "y");
        // The launch itself rejects them too, whatever the machine.
        let r = unsafe { w4a16_gemm_awq(&W4a16Gemm { k: 320, ..a }, Stream::default()) };
        assert_eq!(refused(r), "k");
    }

    #[test]
    fn gemm_plan_shapes() {
        for (m, n, k) in [
            (1, 18432, 7168),
            (16, 2048, 7168),
            (3, 7168, 2048),
            (128, 18432, 7168),
            (40, 96, 256),
        ] {
            let p = gemm_plan(132 * 4, m, n, k, true, None);
            assert!(
                p.k_chunk.is_multiple_of(32)
                    && p.splits * p.k_chunk >= k
                    && (p.splits - 1) * p.k_chunk < k,
                "{p:?}"
            );
            if m <= 16 {
                assert!(p.kernel.takes_log2_group(), "{p:?}");
                assert!(p.smem <= 96 * 1024, "{p:?}");
            } else {
                assert!(p.splits <= 4);
            }
        }
    }

    /// The Hessian grids cover exactly the tiles holding an element `i <= j` of `d × d`
    /// (counted element by element here).
    #[test]
    fn hessian_tiles_cover_the_upper_triangle() {
        for d in [8usize, 64, 128, 130, 256, 264, 384, 520, 776, 2048, 7168] {
            for (ti, tj, got) in [
                (64, 64, upper_tiles(d, 64)),
                (128, 128, upper_tiles(d, 128)),
                (128, 256, hessian_wg_tiles(d)),
            ] {
                let mut want = 0;
                for bi in 0..d.div_ceil(ti) {
                    for bj in 0..d.div_ceil(tj) {
                        // Some i in the row block and j in the column block with i <= j < d.
                        let (i_min, j_max) = (bi * ti, ((bj + 1) * tj).min(d) - 1);
                        want += usize::from(i_min <= j_max);
                    }
                }
                assert_eq!(got, want, "d {d}, tiles {ti} x {tj}");
            }
        }
    }

    #[test]
    fn clusters_only_where_they_pay() {
        // 56 tiles split twice (112 blocks on 132 slots): one wave either way while the device
        // holds 56 clusters of 2, two waves if it holds only 40.
        assert!(cluster_pays(56, 2, 66, 132));
        assert!(cluster_pays(56, 2, 56, 132));
        assert!(!cluster_pays(56, 2, 40, 132));
        // 32 tiles split 4 ways with room for 30 clusters of 4: a second wave the unclustered
        // 128 blocks would not need.
        assert!(!cluster_pays(32, 4, 30, 132));
        // Several waves anyway (144 tiles × 4 on 264 slots: 3 waves; 64 clusters: 3 waves).
        assert!(cluster_pays(144, 4, 64, 264));
        assert!(!cluster_pays(144, 4, 47, 264));
        // A cluster the device cannot launch at all.
        assert!(!cluster_pays(1, 2, 0, 132));
        // Clusters of 8 (7168×1536: 12 tiles) all resident at once: one wave.
        assert!(cluster_pays(12, 8, 15, 132));
        // Clusters of 7 over several waves (16384×7168 at M = 64: 56 tiles, 392 blocks on 264
        // slots, two waves either way) are left to the workspace; clusters of 4 over several
        // waves are not (7168×18432 at M = 128: 144 tiles, 576 blocks, 3 waves either way).
        assert!(!cluster_pays(56, 7, 30, 264));
        assert!(cluster_pays(144, 4, 72, 264));
    }

    #[test]
    fn wg_splits_count_waves_and_cluster_sums() {
        // One wave alone, two blocks an SM, whole waves with a last wave alone.
        assert_eq!(wg_stage_us(112, 132, 2), 0.58);
        assert_eq!(wg_stage_us(264, 132, 2), 0.96);
        assert!((wg_stage_us(288, 132, 2) - (0.96 + 0.58)).abs() < 1e-12);
        assert!((wg_stage_us(576, 132, 2) - (2.0 * 0.96 + 0.58)).abs() < 1e-12);
        // H100, every split count forced (LOG.md, "The split count against every forced
        // split"): 7168×18432 at M = 256 (144 × 2 tiles, 112 stages) ran 180 µs unsplit and 158
        // at 2 splits in clusters (clusters of up to 4 pay there); through the workspace 2
        // splits cost more than they save.
        let (tiles, outputs) = (288, 256 * 18432);
        assert_eq!(
            wg_splits(tiles, 132, 112, outputs, (128, 1.0), &|s| s <= 4).0,
            2
        );
        assert_eq!(
            wg_splits(tiles, 132, 112, outputs, (128, 1.0), &|_| false).0,
            1
        );
        // 7168×2048 at M = 512 (16 × 4 tiles): 34.8 µs at 2 splits in clusters against 38.6 at
        // 4 through the workspace (clusters of 4 do not pay there).
        let (tiles, outputs) = (64, 512 * 2048);
        assert_eq!(
            wg_splits(tiles, 132, 112, outputs, (128, 1.0), &|s| s <= 3).0,
            2
        );
        assert_eq!(
            wg_splits(tiles, 132, 112, outputs, (128, 1.0), &|_| false).0,
            4
        );
        // Rows the model already picked well keep their counts: 2048×7168 at M = 128 2 splits,
        // 7168×18432 at M = 128 3, q_a 7168×1536 at M = 128 8 (all in clusters).
        assert_eq!(
            wg_splits(56, 132, 32, 128 * 7168, (128, 1.0), &|s| s <= 4).0,
            2
        );
        assert_eq!(
            wg_splits(144, 132, 112, 128 * 18432, (128, 1.0), &|s| s <= 4).0,
            3
        );
        assert_eq!(
            wg_splits(12, 132, 112, 128 * 1536, (128, 1.0), &|_| true).0,
            8
        );
    }

    #[test]
    fn gemm_plan_wgmma_shapes() {
        // An H100's 132 SMs, its W4A16 splits all through the workspace.
        let plan = |m, n, k| {
            gemm_plan(
                132 * 4,
                m,
                n,
                k,
                true,
                Some(WgDevice::without_clusters(132)),
            )
        };
        for (m, n, k) in [
            (128, 2048, 7168),
            (128, 7168, 2048),
            (128, 18432, 7168),
            (300, 256, 512),
            (17, 128, 64),
            (5, 7168, 2048),
            (16, 18432, 7168),
        ] {
            assert!(wg_shape_ok(n, k, 64));
            let p = plan(m, n, k);
            let GemmKernel::Wgmma { tokens } = p.kernel else {
                panic!("{p:?}")
            };
            // The smallest tile that holds M (or the smallest of all); past 128, 128 or 256.
            let smallest = WG_TILES[WG_TILES.len() - 1].0;
            assert!(
                WG_TILES.iter().any(|&(t, _)| t == tokens)
                    && (tokens == smallest || tokens / 2 < m || (m > 128 && tokens == 128)),
                "{p:?}"
            );
            assert!(
                p.k_chunk.is_multiple_of(WG_BK)
                    && p.splits * p.k_chunk >= k
                    && (p.splits - 1) * p.k_chunk < k
                    && p.splits <= WG_MAX_SPLITS,
                "{p:?}"
            );
            assert_eq!(p.nblocks * WG_BN, n);
            assert!(
                p.mblocks * tokens >= m && (p.mblocks - 1) * tokens < m,
                "{p:?}"
            );
        }
        // Up to 128 the smallest token tile that holds M (several narrower blocks would each
        // dequantize the weights again).
        let tokens = |m, n, k| match plan(m, n, k).kernel {
            GemmKernel::Wgmma { tokens } => tokens,
            kernel => panic!("{kernel:?}"),
        };
        assert_eq!(
            [5, 16, 17, 32, 33, 64, 65, 128].map(|m| tokens(m, 7168, 2048)),
            [16, 16, 32, 32, 64, 64, 128, 128]
        );
        // Past 128, the tile priced lower. On an H200 (LOG.md, "A 256-token tile") 256 tokens
        // ran 1.00-1.30x faster at M = 1024-4096 on the four DeepSeek-V3 shapes (11 of 12 rows
        // 1.14x or more), and 128 tokens 1.17-1.26x faster at M = 384 on the two large ones
        // (three 128-token blocks against two 256-token blocks, the second half empty).
        for (n, k) in [(2048, 7168), (7168, 2048), (18432, 7168), (7168, 18432)] {
            assert_eq!(
                [1024, 2048, 4096].map(|m| tokens(m, n, k)),
                [256; 3],
                "{n}x{k}"
            );
        }
        // (The GPU test's shapes for the 256-token tile, gemm_case at M = 1024 and 600.)
        assert_eq!(
            [tokens(1024, 4096, 512), tokens(600, 4096, 512)],
            [256, 256]
        );
        assert_eq!(tokens(384, 18432, 7168), 128);
        assert_eq!(tokens(384, 7168, 18432), 128);
        // FORGE_GEMM_WG_TOKENS forces a tile whatever M.
        assert_eq!(wg_tiles(300, Some(32)), [(32, 0.78)]);
        assert_eq!(wg_tiles(5, Some(256)), [(256, 1.4)]);
        assert_eq!(wg_tiles(300, None), [(128, 1.0), (256, 1.4)]);
        // A 16-block grid splits 8 ways, a 56-block one twice, 144 blocks (just over one wave)
        // 3-4 ways; a grid of many waves not at all.
        let splits = |m, n, k| plan(m, n, k).splits;
        assert!((3..=4).contains(&splits(128, 18432, 7168)));
        assert_eq!(splits(128, 2048, 7168), 8);
        assert_eq!(splits(128, 7168, 2048), 2);
        assert_eq!(splits(1024, 18432, 7168), 1);
        // A grid that fits the SMs at one block each asks for more than half an SM's shared
        // memory (228 KB on sm_90), so each block has an SM of its own; larger grids keep two
        // blocks an SM.
        let smem = |m, n, k| plan(m, n, k).smem;
        assert_eq!(smem(256, 7168, 2048), W4A16_WG_SMEM_ALONE as usize); // 112 blocks
        assert_eq!(smem(128, 18432, 7168), W4A16_WG_SMEM as usize); // 144 blocks, split
        assert_eq!(smem(384, 18432, 7168), W4A16_WG_SMEM as usize); // 432 blocks
        assert_eq!(smem(4096, 7168, 2048), W4A16_WG256_SMEM as usize); // 256 tokens
        let per_sm = |smem: u32| (228 * 1024) / (smem as usize + 1024);
        assert_eq!((per_sm(W4A16_WG_SMEM_ALONE), per_sm(W4A16_WG_SMEM)), (1, 2));
        assert_eq!(per_sm(W4A16_WG256_SMEM), 1);
        // M <= 4 keeps a GEMV; shapes the kernel cannot take keep the tiled kernel.
        assert!(plan(4, 2048, 7168).kernel.takes_log2_group());
        assert!(
            !wg_shape_ok(96, 256, 64) && !wg_shape_ok(256, 96, 32) && !wg_shape_ok(256, 256, 32)
        );
    }
}
