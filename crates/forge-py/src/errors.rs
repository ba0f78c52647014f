//! Error conversion: every failure becomes one of the exceptions declared in
//! `python/forge/errors.py`; a Rust panic never reaches Python as `PanicException`.

use pyo3::prelude::*;
use pyo3::types::PyType;

/// Raises `forge.errors.<class>(msg)`.
pub fn raise(py: Python<'_>, class: &str, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    match py
        .import("forge.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from))
    {
        Ok(ty) => PyErr::from_type(ty, (msg,)),
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(msg),
    }
}

/// Maps a core error to its Python exception.
pub fn core_err(py: Python<'_>, e: forge_core::Error) -> PyErr {
    use forge_core::Error as E;
    let class = match &e {
        E::Shape { .. } => "ShapeError",
        E::Param { .. } | E::NonFinite { .. } => "InvalidValueError",
        E::NotPositiveDefinite { .. } => "HessianError",
    };
    raise(py, class, e.to_string())
}

/// Runs `f` without the GIL and converts a panic into `forge.errors.KernelError`.
pub fn detach_guarded<T: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let r = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    r.map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        raise(py, "KernelError", format!("{what}: internal error: {msg}"))
    })
}
