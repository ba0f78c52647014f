//! `forge._native`: the PyO3 bindings of 4bit-forge. Type and error conversion only; the
//! maths lives in `forge-core`. Internal API: use the `forge` package.

mod cuda_ops;
mod errors;
mod ops;
mod run;
mod tensor;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("TILED_MAX_M", forge_cuda::ops::TILED_MAX_M)?;
    m.add("W4A16_N_MULTIPLE", forge_cuda::ops::W4A16_N_MULTIPLE)?;
    m.add("MOE_ROUTE_MAX_PAIRS", forge_cuda::ops::MOE_ROUTE_MAX_PAIRS)?;
    m.add(
        "MOE_ROUTE_MAX_EXPERTS",
        forge_cuda::ops::MOE_ROUTE_MAX_EXPERTS,
    )?;
    m.add(
        "MOE_COMBINE_MAX_TOKENS",
        forge_cuda::ops::MOE_COMBINE_MAX_TOKENS,
    )?;
    m.add(
        "GROUPED_MAX_SEGMENTS",
        forge_cuda::ops::GROUPED_MAX_SEGMENTS,
    )?;
    m.add("GROUPED_TC_ROWS", forge_cuda::ops::GROUPED_TC_ROWS.to_vec())?;
    m.add_function(wrap_pyfunction!(ops::build_quant_grid, m)?)?;
    m.add_function(wrap_pyfunction!(ops::quantize_rtn, m)?)?;
    m.add_function(wrap_pyfunction!(ops::encode_qmeta, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_qmeta, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gptq_solve, m)?)?;
    m.add_function(wrap_pyfunction!(ops::pack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::quantize_pack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::unpack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequantize_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::tile_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::awq_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(ops::pack_gptq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::unpack_gptq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequantize_gptq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gptq_solve_batched, m)?)?;
    m.add_function(wrap_pyfunction!(ops::hessian_update, m)?)?;
    m.add_function(wrap_pyfunction!(ops::hessian_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(ops::hessian_update_segmented, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_plan, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_grouped_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::moe_route_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::moe_combine_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::silu_mul_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::moe_max_segments, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::tile_shape_ok, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::grouped_tc_max_rows, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::grouped_gemv_shape_ok, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_tile_repack_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::awq_dequant_launch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_ops::w4a16_tiled_launch, m)?)?;
    m.add_function(wrap_pyfunction!(
        cuda_ops::w4a16_grouped_workspace_bytes,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(run::quantize_model, m)?)?;
    m.add_function(wrap_pyfunction!(run::default_options, m)?)?;
    m.add_function(wrap_pyfunction!(run::validate_options, m)?)?;
    m.add_class::<run::Session>()?;
    m.add_class::<run::MappedTensor>()?;
    m.add_function(wrap_pyfunction!(run::inspect, m)?)?;
    m.add_function(wrap_pyfunction!(run::verify, m)?)?;
    m.add_function(wrap_pyfunction!(run::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(run::select_experts, m)?)?;
    Ok(())
}
