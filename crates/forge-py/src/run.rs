//! Bindings of the quantization run (`forge-run`): `quantize_model`, `inspect`, `verify` and
//! `cli_main`. Type and error conversion only; the GIL is released while Rust works.

use std::path::PathBuf;

use forge_core::grid::GridMode;
use forge_core::MseSpec;
use forge_run::arch::Pattern;
use forge_run::run::{Progress, RunOptions};
use forge_run::{Error, QuantOptions};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde_json::Value;

use crate::errors::raise;

/// Maps a run error to its Python exception.
fn run_err(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    if let Some(io) = e.io_error() {
        return match io.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => match io.raw_os_error() {
                Some(code) => PyOSError::new_err((code, msg)),
                None => PyOSError::new_err(msg),
            },
        };
    }
    let class = match &e {
        Error::NonFinite { .. } | Error::Options { .. } => "InvalidValueError",
        Error::Quantize { source, .. } => match source.as_ref() {
            forge_core::Error::Shape { .. } => "ShapeError",
            _ => "InvalidValueError",
        },
        Error::Unpackable { .. } => "ShapeError",
        Error::Quantizer { .. } => "KernelError",
        _ => "CheckpointError",
    };
    raise(py, class, msg)
}

/// Converts a JSON value to Python objects (dict, list, str, int, float, bool, None).
fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any().unbind()
            } else if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any().unbind()
            } else {
                n.as_f64()
                    .unwrap_or(f64::NAN)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind()
            }
        }
        Value::String(s) => s.into_pyobject(py)?.into_any().unbind(),
        Value::Array(a) => {
            let l = PyList::empty(py);
            for x in a {
                l.append(to_py(py, x)?)?;
            }
            l.into_any().unbind()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, to_py(py, x)?)?;
            }
            d.into_any().unbind()
        }
    })
}

/// Progress for Python: the indicatif bar (when asked for and stderr is a terminal), and a
/// check for KeyboardInterrupt between units.
struct PyProgress {
    bar: Option<forge_run::cli::BarProgress>,
    interrupted: std::sync::Mutex<Option<PyErr>>,
}

impl Progress for PyProgress {
    fn start(&self, units: usize, bytes: u64, done_units: usize, done_bytes: u64) {
        if let Some(b) = &self.bar {
            b.start(units, bytes, done_units, done_bytes);
        }
    }
    fn unit_done(&self, label: &str, bytes: u64) -> bool {
        if let Some(b) = &self.bar {
            b.unit_done(label, bytes);
        }
        match Python::attach(|py| py.check_signals()) {
            Ok(()) => true,
            Err(e) => {
                if let Ok(mut slot) = self.interrupted.lock() {
                    *slot = Some(e);
                }
                false
            }
        }
    }
    fn note(&self, msg: &str) {
        if let Some(b) = &self.bar {
            b.note(msg);
        }
    }
    fn finishing(&self) {
        if let Some(b) = &self.bar {
            b.finishing();
        }
    }
}

fn patterns(py: Python<'_>, option: &str, v: Vec<String>) -> PyResult<Vec<Pattern>> {
    forge_run::cli::patterns(option, &v).map_err(|e| run_err(py, e))
}

/// Quantizes a checkpoint folder to 4-bit AWQ; returns the run report as a dict.
#[pyfunction]
#[pyo3(signature = (model_dir, out_dir, *, method = "rtn", group_size = 128, symmetric = false,
    exclude = Vec::new(), include = Vec::new(), default_excludes = true, skip_unpackable = false,
    max_shard_size = "5GB".to_string(), resume = false, overwrite = false, threads = None, device = "cpu".to_string(),
    progress = true, mse_grid = 100, mse_shrink = 0.2, mse_norm = 2.4))]
#[allow(clippy::too_many_arguments)]
pub fn quantize_model(
    py: Python<'_>,
    model_dir: PathBuf,
    out_dir: PathBuf,
    method: &str,
    group_size: usize,
    symmetric: bool,
    exclude: Vec<String>,
    include: Vec<String>,
    default_excludes: bool,
    skip_unpackable: bool,
    max_shard_size: String,
    resume: bool,
    overwrite: bool,
    threads: Option<usize>,
    device: String,
    progress: bool,
    mse_grid: usize,
    mse_shrink: f32,
    mse_norm: f32,
) -> PyResult<Py<PyAny>> {
    let grid = match method {
        "rtn" | "range" => GridMode::Range,
        "mse" => {
            let m = MseSpec {
                max_shrink: mse_shrink,
                n_grid: mse_grid,
                norm: mse_norm,
            };
            m.validate()
                .map_err(|e| raise(py, "InvalidValueError", e.to_string()))?;
            GridMode::Mse(m)
        }
        other => {
            return Err(raise(
                py,
                "InvalidValueError",
                format!("method must be \"rtn\" or \"mse\", got {other:?}"),
            ))
        }
    };
    let opts = RunOptions {
        quant: QuantOptions {
            group_size,
            symmetric,
            grid,
            include: patterns(py, "include", include)?,
            exclude: patterns(py, "exclude", exclude)?,
            default_excludes,
            skip_unpackable,
            max_shard_bytes: forge_run::cli::parse_size(&max_shard_size)
                .map_err(|e| run_err(py, e))?,
        },
        resume,
        overwrite,
        threads,
        cuda_device: forge_run::cli::parse_device(&device).map_err(|e| run_err(py, e))?,
    };
    let prog = PyProgress {
        bar: progress.then(|| forge_run::cli::BarProgress::new(true)),
        interrupted: std::sync::Mutex::new(None),
    };
    let result = crate::errors::detach_guarded(py, "quantize_model", || {
        forge_run::quantize(&model_dir, &out_dir, &opts, &prog)
    })?;
    drop(prog.bar);
    if let Some(e) = prog.interrupted.lock().ok().and_then(|mut s| s.take()) {
        return Err(e);
    }
    let report = result.map_err(|e| run_err(py, e))?;
    to_py(py, &report.to_json())
}

/// Summarises a checkpoint folder (layers, experts, dtypes, sizes, quantization status).
#[pyfunction]
pub fn inspect(py: Python<'_>, path: PathBuf) -> PyResult<Py<PyAny>> {
    let v = crate::errors::detach_guarded(py, "inspect", || forge_run::inspect::inspect(&path))?
        .map_err(|e| run_err(py, e))?;
    to_py(py, &v)
}

/// Checks an output folder; returns `{"ok": bool, "problems": [...], ...}`.
#[pyfunction]
pub fn verify(py: Python<'_>, path: PathBuf) -> PyResult<Py<PyAny>> {
    let r = crate::errors::detach_guarded(py, "verify", || forge_run::verify::check(&path))?
        .map_err(|e| run_err(py, e))?;
    to_py(py, &r.to_json())
}

/// Runs the `forge-rs` command line on `argv` (program name first); returns the exit code.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    crate::errors::detach_guarded(py, "cli", || forge_run::cli::main(argv))
}
