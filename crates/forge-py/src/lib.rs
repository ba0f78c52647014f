//! `forge._native`: the PyO3 bindings of 4bit-forge. Type and error conversion only; the
//! maths lives in `forge-core`. Internal API: use the `forge` package.

mod errors;
mod ops;
mod tensor;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(ops::build_quant_grid, m)?)?;
    m.add_function(wrap_pyfunction!(ops::quantize_rtn, m)?)?;
    m.add_function(wrap_pyfunction!(ops::encode_qmeta, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_qmeta, m)?)?;
    m.add_function(wrap_pyfunction!(ops::prepare_hessian, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gptq_solve, m)?)?;
    m.add_function(wrap_pyfunction!(ops::pack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::quantize_pack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::unpack_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequantize_awq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::awq_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(ops::pack_gptq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::unpack_gptq, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequantize_gptq, m)?)?;
    Ok(())
}
