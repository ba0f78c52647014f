//! The kernel table: which `cuda/*.cu` module holds each entry point, and the generated
//! header (forge-core's qmeta and fp8 tables, bit for bit) prepended to every module.

use std::fmt::Write;

const COMMON: &str = include_str!("../../../cuda/common.cuh");

/// A source module of `cuda/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// `cuda/grid.cu`: qmeta range grid and MSE / L^p search.
    Grid,
    /// `cuda/pack.cu`: fused AWQ quantize+pack, AWQ and GPTQ v1 packing of codes.
    Pack,
    /// `cuda/gemm.cu`: W4A16 GEMM on the AWQ layout.
    Gemm,
    /// `cuda/hessian.cu`: H += XᵀX, plain and segmented.
    Hessian,
    /// `cuda/gptq.cu`: blocked GPTQ solver.
    Gptq,
}

impl Module {
    /// Every module.
    pub const ALL: [Module; 5] = [
        Module::Grid,
        Module::Pack,
        Module::Gemm,
        Module::Hessian,
        Module::Gptq,
    ];

    /// File stem in `cuda/`.
    pub fn name(self) -> &'static str {
        match self {
            Module::Grid => "grid",
            Module::Pack => "pack",
            Module::Gemm => "gemm",
            Module::Hessian => "hessian",
            Module::Gptq => "gptq",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Module::Grid => include_str!("../../../cuda/grid.cu"),
            Module::Pack => include_str!("../../../cuda/pack.cu"),
            Module::Gemm => include_str!("../../../cuda/gemm.cu"),
            Module::Hessian => include_str!("../../../cuda/hessian.cu"),
            Module::Gptq => include_str!("../../../cuda/gptq.cu"),
        }
    }

    /// The kernel entry points this module defines.
    pub fn kernels(self) -> &'static [&'static str] {
        match self {
            Module::Grid => &[
                "qmeta_range_f32",
                "qmeta_range_f16",
                "qmeta_range_bf16",
                "qmeta_range_f8e4m3",
                "qmeta_range_tpg_f32",
                "qmeta_range_tpg_f16",
                "qmeta_range_tpg_bf16",
                "qmeta_range_tpg_f8e4m3",
                "qmeta_range_oct_f32",
                "qmeta_range_oct_f16",
                "qmeta_range_oct_bf16",
                "qmeta_range_oct_f8e4m3",
                "qmeta_mse_f32",
                "qmeta_mse_f16",
                "qmeta_mse_bf16",
                "qmeta_mse_f8e4m3",
            ],
            Module::Pack => &[
                "awq_quant_pack_f32",
                "awq_quant_pack_f16",
                "awq_quant_pack_bf16",
                "awq_quant_pack_f8e4m3",
                "awq_pack_codes",
                "awq_pack_meta",
                "gptq_pack_codes",
                "gptq_pack_meta",
            ],
            Module::Gemm => &[
                "w4a16_awq_f16_m1",
                "w4a16_awq_f16_m2",
                "w4a16_awq_f16_m4",
                "w4a16_awq_bf16_m1",
                "w4a16_awq_bf16_m2",
                "w4a16_awq_bf16_m4",
                "w4a16_awqg_f16_m1",
                "w4a16_awqg_f16_m2",
                "w4a16_awqg_f16_m4",
                "w4a16_awqg_bf16_m1",
                "w4a16_awqg_bf16_m2",
                "w4a16_awqg_bf16_m4",
                "w4a16_wg_f16_t256",
                "w4a16_wg_bf16_t256",
                "w4a16_wg_f16_t128",
                "w4a16_wg_bf16_t128",
                "w4a16_wg_f16_t64",
                "w4a16_wg_bf16_t64",
                "w4a16_wg_f16_t32",
                "w4a16_wg_bf16_t32",
                "w4a16_wg_f16_t16",
                "w4a16_wg_bf16_t16",
                "w4a16_wgg_f16_t256",
                "w4a16_wgg_bf16_t256",
                "w4a16_wgg_f16_t128",
                "w4a16_wgg_bf16_t128",
                "w4a16_wgg_f16_t64",
                "w4a16_wgg_bf16_t64",
                "w4a16_wgg_f16_t32",
                "w4a16_wgg_bf16_t32",
                "w4a16_wgg_f16_t16",
                "w4a16_wgg_bf16_t16",
                "w4a16_gemv_f16",
                "w4a16_gemv_bf16",
                "w4a16_gemv3_f16_r1",
                "w4a16_gemv3_f16_r2",
                "w4a16_gemv3_f16_r4",
                "w4a16_gemv3_bf16_r1",
                "w4a16_gemv3_bf16_r2",
                "w4a16_gemv3_bf16_r4",
                "w4a16_gemv3g_f16_r1",
                "w4a16_gemv3g_f16_r2",
                "w4a16_gemv3g_f16_r4",
                "w4a16_gemv3g_bf16_r1",
                "w4a16_gemv3g_bf16_r2",
                "w4a16_gemv3g_bf16_r4",
                "moe_route",
                "moe_combine",
                "silu_mul",
                "w4a16_reduce_f16",
                "w4a16_reduce_bf16",
                "w4a16_tile_repack",
                "awq_dequant_f32",
                "awq_dequant_f16",
                "awq_dequant_bf16",
                "w4a16_gemv_tiled_f16",
                "w4a16_gemv_tiled_bf16",
                "w4a16_gemv_tiled16_f16",
                "w4a16_gemv_tiled16_bf16",
            ],
            Module::Hessian => &[
                "hessian_accum_f32",
                "hessian_accum_f16",
                "hessian_accum_bf16",
                "hessian_tc_f16",
                "hessian_tc_bf16",
                "hessian_wg_f16",
                "hessian_wg_bf16",
            ],
            Module::Gptq => &["gptq_block_f32", "gptq_trail_tf32x3"],
        }
    }
}

/// The module that defines kernel `name`.
pub fn module_of(name: &str) -> Option<Module> {
    Module::ALL
        .into_iter()
        .find(|m| m.kernels().contains(&name))
}

/// Dynamic shared memory (bytes) a kernel may need beyond the default 48 KB.
pub fn dynamic_smem_limit(name: &str) -> Option<usize> {
    if name.starts_with("hessian_tc") {
        Some(crate::ops::HESSIAN_TC_SMEM as usize)
    } else if name.starts_with("hessian_wg") {
        Some(crate::ops::HESSIAN_WG_SMEM as usize)
    } else if name.starts_with("w4a16_wg") {
        // The most a launch asks: its tile's, or half an SM's when its grid fits the SMs.
        let tokens = name
            .rsplit_once("_t")
            .map_or(0, |(_, t)| t.parse().unwrap_or(0));
        Some(crate::ops::wg_tile_smem(tokens).max(crate::ops::W4A16_WG_SMEM_ALONE) as usize)
    } else if name == "awq_quant_pack_f32" {
        // 64 KB of row tiles (the other dtypes' 16 / 32 KB are under the default 48 KB).
        Some(crate::ops::pack_smem(crate::ops::DType::F32) as usize)
    } else {
        None
    }
}

/// Every kernel entry point.
pub fn all_kernels() -> impl Iterator<Item = &'static str> {
    Module::ALL
        .into_iter()
        .flat_map(|m| m.kernels().iter().copied())
}

/// Where a generated table lives: global memory (read through L1, like any load) or the
/// constant bank (its own cache, serialized over the distinct indices of a warp).
#[derive(Clone, Copy)]
enum TableSpace {
    Global,
    Constant,
}

fn table(out: &mut String, name: &str, space: TableSpace, vals: impl Iterator<Item = u32>) {
    let qualifier = match space {
        TableSpace::Global => "__device__ const",
        TableSpace::Constant => "__constant__",
    };
    let _ = write!(out, "{qualifier} unsigned int {name}[256] = {{");
    for (i, v) in vals.enumerate() {
        if i % 8 == 0 {
            out.push_str("\n    ");
        }
        let _ = write!(out, "0x{v:08x}u, ");
    }
    out.push_str("\n};\n");
}

/// The generated header: forge-core's THRESH / POW2 / E4M3 tables as bit patterns, and the
/// launch constants the kernels share with `ops`.
pub fn generated_header() -> String {
    let t = &*forge_core::qmeta::TABLES;
    let mut s = String::from("// generated by forge-cuda from forge-core's tables; do not edit\n");
    let _ = writeln!(s, "#define TILED_MAX_WARPS {}", crate::ops::TILED_MAX_WARPS);
    let _ = writeln!(
        s,
        "#define TILED16_MAX_WARPS {}",
        crate::ops::TILED16_MAX_WARPS
    );
    let _ = writeln!(s, "#define WG_MAX_SPLITS {}", crate::ops::WG_MAX_SPLITS);
    // The fused quantize + pack's tiles (the 16- and 32-bit types share one) and threads.
    let (pack, pack8) = (
        crate::ops::pack_tile(crate::ops::DType::Bf16),
        crate::ops::pack_tile(crate::ops::DType::F8E4M3),
    );
    for (name, v) in [
        ("QP_BN", pack.0),
        ("QP_BK", pack.1),
        ("QP8_BN", pack8.0),
        ("QP8_BK", pack8.1),
        ("PACK_THREADS", crate::ops::PACK_THREADS as usize),
    ] {
        let _ = writeln!(s, "#define {name} {v}");
    }
    for (name, v) in [
        ("WG_OUT_Y", crate::ops::WG_OUT_Y),
        ("WG_OUT_PARTIALS", crate::ops::WG_OUT_PARTIALS),
        ("WG_OUT_CLUSTER", crate::ops::WG_OUT_CLUSTER),
    ] {
        let _ = writeln!(s, "#define {name} {v}");
    }
    table(
        &mut s,
        "FORGE_THRESH_BITS",
        TableSpace::Global,
        t.thresh.iter().map(|v| v.to_bits()),
    );
    // POW2 is read once a group, by the grid decode the FP8 pack waits for at its barrier:
    // in global memory that dependent load queued behind the block's tile copies in L1TEX
    // (H200, 18432x7168 FP8 with block scales 63.2 -> 60.4 µs kernel alone in constant
    // memory; LOG.md "Constant POW2, block scale first"). E4M3 stays in global memory: it is
    // read per element, with up to 32 distinct indices a warp.
    table(
        &mut s,
        "FORGE_POW2_BITS",
        TableSpace::Constant,
        t.pow2.iter().map(|v| v.to_bits()),
    );
    table(
        &mut s,
        "FORGE_E4M3_BITS",
        TableSpace::Global,
        forge_core::dtype::E4M3_TABLE.iter().map(|v| v.to_bits()),
    );
    s
}

/// Complete source handed to NVRTC for a module: generated header + common.cuh + module.
///
/// Development aid: when `FORGE_CUDA_SRC` names a directory, `common.cuh` and
/// `<module>.cu` found there replace the embedded copies (the cache key covers the text).
pub fn full_source(m: Module) -> String {
    let over = |file: &str| {
        std::env::var_os("FORGE_CUDA_SRC")
            .and_then(|d| std::fs::read_to_string(std::path::Path::new(&d).join(file)).ok())
    };
    let common = over("common.cuh").unwrap_or_else(|| COMMON.to_string());
    let module = over(&format!("{}.cu", m.name())).unwrap_or_else(|| m.source().to_string());
    let mut s = generated_header();
    s.push_str("#line 1 \"common.cuh\"\n");
    s.push_str(&common);
    let _ = writeln!(s, "#line 1 \"{}.cu\"", m.name());
    s.push_str(&module);
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_in_its_source() {
        for m in Module::ALL {
            for k in m.kernels() {
                let src = m.source();
                // Entry points are defined either literally or through a `##SUF` macro.
                let literal = src.contains(&format!(" {k}("));
                let via_macro = k
                    .match_indices('_')
                    .any(|(i, _)| src.contains(&format!("{}_##SUF", &k[..i])));
                assert!(literal || via_macro, "{k} not found in {}.cu", m.name());
                assert_eq!(module_of(k), Some(m));
            }
        }
    }

    #[test]
    fn fp8_block_of_the_kernels_is_forge_cores() {
        let define = format!("#define FORGE_FP8_BLOCK {}\n", forge_core::dtype::FP8_BLOCK);
        assert!(COMMON.contains(&define), "common.cuh lacks {define:?}");
    }

    #[test]
    fn header_has_the_tables() {
        let h = generated_header();
        assert!(h.contains("FORGE_THRESH_BITS[256]"));
        assert!(h.contains("__constant__ unsigned int FORGE_POW2_BITS[256]"));
        assert!(h.contains("FORGE_E4M3_BITS[256]"));
        assert!(h.contains("#define TILED_MAX_WARPS 32\n"));
        assert!(h.contains("#define TILED16_MAX_WARPS 16\n"));
        // 2^0 = 1.0 is POW2[0].
        assert!(h.contains("0x3f800000u"));
        let src = full_source(Module::Gemm);
        assert!(src.contains("w4a16_awq_impl"));
    }
}
