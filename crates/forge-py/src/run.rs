//! Bindings of the quantization run (`forge-run`): the options, the data-free
//! `quantize_model`, the [`Session`] a calibrated run drives from Python, `inspect`,
//! `verify` and `cli_main`. Type and error conversion only; the GIL is released while
//! Rust works.

use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::Arc;

use forge_core::QMeta;
use forge_io::{Checkpoint, Dtype};
use forge_run::cli::Outcome;
use forge_run::plan::Action;
use forge_run::run::Progress;
use forge_run::{Error, Options};
use pyo3::exceptions::{PyBufferError, PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use serde_json::Value;

use crate::errors::raise;
use crate::tensor::{DType, Tensor};

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

/// Parses options given as a JSON string (Python serialises its dict with `json.dumps`).
fn options_from(py: Python<'_>, json: &str) -> PyResult<Options> {
    let v: Value = serde_json::from_str(json).map_err(|e| {
        raise(
            py,
            "InvalidValueError",
            format!("options are not JSON-serialisable values: {e}"),
        )
    })?;
    Options::from_json(&v).map_err(|e| run_err(py, e))
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

/// Every option with its default, as a dict.
#[pyfunction]
pub fn default_options(py: Python<'_>) -> PyResult<Py<PyAny>> {
    to_py(py, &Options::default().to_json())
}

/// Validates options (a JSON string of a dict) and returns them complete, as a dict.
#[pyfunction]
pub fn validate_options(py: Python<'_>, options: &str) -> PyResult<Py<PyAny>> {
    let o = options_from(py, options)?;
    to_py(py, &o.to_json())
}

/// Quantizes a checkpoint folder data-free; `options` is a JSON string of a dict.
#[pyfunction]
pub fn quantize_model(
    py: Python<'_>,
    model_dir: PathBuf,
    out_dir: PathBuf,
    options: &str,
) -> PyResult<Py<PyAny>> {
    let opts = options_from(py, options)?;
    let prog = PyProgress {
        bar: opts
            .progress
            .then(|| forge_run::cli::BarProgress::new(true)),
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

/// Read-only bytes of one source tensor inside the checkpoint's memory map,
/// exposed through the buffer protocol (`torch.frombuffer` makes a tensor of it
/// without a copy). Keeps the maps alive while any view of it exists.
#[pyclass(module = "forge._native", frozen)]
pub struct MappedTensor {
    _ckpt: Arc<Checkpoint>,
    ptr: usize,
    len: isize,
    /// Name of the tensor.
    #[pyo3(get)]
    name: String,
    /// safetensors dtype (`BF16`, `F8_E4M3`, ...).
    #[pyo3(get)]
    dtype: String,
    /// Shape.
    #[pyo3(get)]
    shape: Vec<usize>,
    /// File holding it.
    #[pyo3(get)]
    file: String,
}

#[pymethods]
impl MappedTensor {
    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        if (flags & pyo3::ffi::PyBUF_WRITABLE) == pyo3::ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "checkpoint tensors are read-only (memory-mapped)",
            ));
        }
        let this = slf.get();
        // SAFETY: `view` is valid per the protocol; the fields point into `this`,
        // which lives while `view.obj` holds a reference to it.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = this.ptr as *mut std::os::raw::c_void;
            (*view).len = this.len;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = if (flags & pyo3::ffi::PyBUF_FORMAT) == pyo3::ffi::PyBUF_FORMAT {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if (flags & pyo3::ffi::PyBUF_ND) == pyo3::ffi::PyBUF_ND {
                &this.len as *const isize as *mut isize
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if (flags & pyo3::ffi::PyBUF_STRIDES) == pyo3::ffi::PyBUF_STRIDES {
                &(*view).itemsize as *const isize as *mut isize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// # Safety
    /// Called by Python's buffer protocol.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len as usize
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// A quantization run driven from Python (the calibrated GPTQ run): Rust reads, plans,
/// writes and resumes; Python runs the forward pass and the solver. See
/// `forge_run::session`.
#[pyclass(module = "forge._native")]
pub struct Session {
    inner: Option<forge_run::Session>,
}

impl Session {
    fn get(&self, py: Python<'_>) -> PyResult<&forge_run::Session> {
        self.inner
            .as_ref()
            .ok_or_else(|| raise(py, "CheckpointError", "the session is finished"))
    }
}

#[pymethods]
impl Session {
    /// Opens a run (plan, output folder, resume); `options` is a JSON string of a dict.
    #[new]
    fn new(py: Python<'_>, model_dir: PathBuf, out_dir: PathBuf, options: &str) -> PyResult<Self> {
        let opts = options_from(py, options)?;
        let s = crate::errors::detach_guarded(py, "session", || {
            forge_run::Session::open(&model_dir, &out_dir, &opts)
        })?
        .map_err(|e| run_err(py, e))?;
        Ok(Session { inner: Some(s) })
    }

    /// The validated options (every key).
    fn options(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py(py, &self.get(py)?.options().to_json())
    }

    /// The source config.json (None when absent).
    fn config(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py(py, self.get(py)?.config())
    }

    /// Family name, notes, modules_to_not_convert and whether the source is FP8.
    fn summary(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let s = self.get(py)?;
        let p = s.plan();
        let (resumed, resumed_bytes) = s.resumed();
        to_py(
            py,
            &serde_json::json!({
                "arch": p.arch.name,
                "notes": p.notes,
                "modules_to_not_convert": p.not_convert,
                "fp8_source": p.fp8_source,
                "resumed_units": resumed,
                "resumed_bytes": resumed_bytes,
                "fp8_block": forge_io::FP8_BLOCK,
                // Bytes of the source tensors and of the planned output (all units).
                "bytes_in": p.units.iter().map(|u| u.bytes_in).sum::<u64>(),
                "bytes_out": p
                    .specs
                    .iter()
                    .map(|t| (t.shape.iter().product::<usize>() * t.dtype.size()) as u64)
                    .sum::<u64>(),
            }),
        )
        .and_then(|d| {
            let pruning: Py<PyAny> = match s.pruning() {
                None => py.None(),
                Some(p) => {
                    let v = to_py(py, &p.to_json())?;
                    let dict = v.bind(py).cast::<PyDict>()?.clone();
                    // Layer keys as ints.
                    let keep = PyDict::new(py);
                    for (l, k) in &p.keep {
                        keep.set_item(l, k)?;
                    }
                    dict.set_item("keep", keep)?;
                    v
                }
            };
            d.bind(py).cast::<PyDict>()?.set_item("pruning", pruning)?;
            Ok(d)
        })
    }

    /// Binds the experts MoE layer `layer` keeps (source ids, ascending): compact slot `c`
    /// is written from expert `keep_ids[c]`. Before the layer is written; recorded for resume.
    fn bind_experts(&mut self, py: Python<'_>, layer: usize, keep_ids: Vec<usize>) -> PyResult<()> {
        let s = self
            .inner
            .as_mut()
            .ok_or_else(|| raise(py, "CheckpointError", "the session is finished"))?;
        s.bind_experts(layer, &keep_ids).map_err(|e| run_err(py, e))
    }

    /// `{layer: [E ints]}` of the bound layers: compact id of each source expert, or -1.
    fn expert_map(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let d = PyDict::new(py);
        for (l, m) in self.get(py)?.expert_map() {
            d.set_item(l, m)?;
        }
        Ok(d.into_any().unbind())
    }

    /// Quantizes unit `index`'s planned linears data-free (the RTN run's grid, format and
    /// device) and writes them.
    fn quantize_rtn(&self, py: Python<'_>, index: usize) -> PyResult<()> {
        let s = self.get(py)?;
        crate::errors::detach_guarded(py, "quantize_rtn", || s.quantize_rtn(index))?
            .map_err(|e| run_err(py, e))
    }

    /// The units in processing order: key, label, layer, mtp, done, bytes_in, linears
    /// (module, weight, n, k) and tensors (name, action).
    fn units(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let s = self.get(py)?;
        let units: Vec<Value> = s
            .plan()
            .units
            .iter()
            .enumerate()
            .map(|(i, u)| {
                serde_json::json!({
                    "index": i,
                    "key": u.key,
                    "label": u.label,
                    "layer": u.layer,
                    "mtp": u.mtp,
                    "done": s.is_done(i),
                    "bytes_in": u.bytes_in,
                    "linears": u.linears.iter().map(|l| serde_json::json!({
                        "module": l.module,
                        "weight": (!l.weight.is_empty()).then_some(&l.weight),
                        "n": l.n,
                        "k": l.k
                    })).collect::<Vec<_>>(),
                    "experts": u.experts.as_ref().map(|x| serde_json::json!({
                        "prefix": x.prefix, "keep": x.keep,
                    })),
                    "tensors": u.tensors.iter().map(|(name, a)| serde_json::json!({
                        "name": name,
                        "action": match a {
                            Action::Quantize(_) => "quantize",
                            Action::Copy => "copy",
                            Action::ToBf16 => "to_bf16",
                            Action::Drop => "drop",
                            Action::Expert => "expert",
                            Action::SliceRows => "slice_rows",
                        }
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        to_py(py, &Value::Array(units))
    }

    /// Whether the source holds a tensor of this name.
    fn has_tensor(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        Ok(self.get(py)?.checkpoint().get(name).is_some())
    }

    /// Reads unit `index`'s source tensors ahead in the background (a page-cache hint).
    fn prefetch(&self, py: Python<'_>, index: usize) -> PyResult<()> {
        self.get(py)?.prefetch(index).map_err(|e| run_err(py, e))
    }

    /// A zero-copy view of a source tensor's bytes (see `MappedTensor`).
    fn tensor(&self, py: Python<'_>, name: &str) -> PyResult<MappedTensor> {
        let s = self.get(py)?;
        let ckpt = s.checkpoint_arc();
        let t = ckpt.tensor(name).map_err(|e| run_err(py, e.into()))?;
        Ok(MappedTensor {
            ptr: t.bytes.as_ptr() as usize,
            len: t.bytes.len() as isize,
            name: name.to_owned(),
            dtype: dtype_name(t.dtype),
            shape: t.shape.to_vec(),
            file: t.file.display().to_string(),
            _ckpt: Arc::clone(&ckpt),
        })
    }

    /// Writes unit `index`'s unquantized tensors (copies; FP8 → bf16).
    fn write_unquantized(&self, py: Python<'_>, index: usize) -> PyResult<()> {
        let s = self.get(py)?;
        crate::errors::detach_guarded(py, "write_unquantized", || s.write_unquantized(index))?
            .map_err(|e| run_err(py, e))
    }

    /// Packs and writes a quantized linear from its codes `(K, N)` uint8 and its grid
    /// `(N, K/G, 4)` uint8 (CPU tensors).
    fn write_linear(
        &self,
        py: Python<'_>,
        module: &str,
        codes: &Bound<'_, PyAny>,
        qmeta: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let s = self.get(py)?;
        let c = Tensor::extract("codes", codes)?;
        let q = Tensor::extract("qmeta", qmeta)?;
        for t in [&c, &q] {
            t.require_cpu()?;
            t.require_dtype(&[DType::U8])?;
        }
        if q.numel() % 4 != 0 {
            return Err(raise(
                py,
                "ShapeError",
                format!("qmeta: expected (N, K/G, 4) uint8, got {:?}", q.shape),
            ));
        }
        // SAFETY: contiguous CPU tensors alive for this call (held by `c`/`q`).
        let codes: &[u8] = unsafe { c.slice::<u8>() };
        let raw: &[u8] = unsafe { q.slice::<u8>() };
        let qm: Vec<QMeta> = raw
            .chunks_exact(4)
            .map(|b| QMeta(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect();
        crate::errors::detach_guarded(py, "write_linear", || s.write_linear(module, codes, &qm))?
            .map_err(|e| run_err(py, e))
    }

    /// Where to write the state recorded with unit `index`'s commit.
    fn state_path(&self, py: Python<'_>, index: usize) -> PyResult<PathBuf> {
        self.get(py)?.state_path(index).map_err(|e| run_err(py, e))
    }

    /// `(unit key, path)` of the state recorded with the last finished layer, or None.
    fn resume_state(&self, py: Python<'_>) -> PyResult<Option<(String, PathBuf)>> {
        Ok(self.get(py)?.resume_state())
    }

    /// Makes unit `index` durable (its shards and `state` fsynced) without recording it; safe
    /// to run on another thread while the next unit is worked on. `commit` then only records.
    ///
    /// The session is borrowed only to take the job, not while the fsyncs run, so the
    /// caller's thread may meanwhile bind experts and commit (methods that take it whole).
    #[pyo3(signature = (index, state = None))]
    fn sync_unit(slf: &Bound<'_, Self>, index: usize, state: Option<PathBuf>) -> PyResult<()> {
        let py = slf.py();
        let job = {
            let this = slf.try_borrow()?;
            this.get(py)?
                .unit_sync(index, state.as_deref())
                .map_err(|e| run_err(py, e))?
        };
        crate::errors::detach_guarded(py, "sync_unit", || job.run())?.map_err(|e| run_err(py, e))
    }

    /// Marks unit `index` finished (every output written), recording `state` with it.
    #[pyo3(signature = (index, state = None))]
    fn commit(&mut self, py: Python<'_>, index: usize, state: Option<PathBuf>) -> PyResult<()> {
        let s = self
            .inner
            .as_mut()
            .ok_or_else(|| raise(py, "CheckpointError", "the session is finished"))?;
        s.commit(index, state.as_deref())
            .map_err(|e| run_err(py, e))
    }

    /// Publishes the output (index, side files, `extra` {file name: bytes}, config.json last)
    /// and returns the run report.
    #[pyo3(signature = (extra = None))]
    fn finish(
        &mut self,
        py: Python<'_>,
        extra: Option<Vec<(String, Py<PyBytes>)>>,
    ) -> PyResult<Py<PyAny>> {
        let files: Vec<(String, Vec<u8>)> = extra
            .unwrap_or_default()
            .into_iter()
            .map(|(n, b)| (n, b.as_bytes(py).to_vec()))
            .collect();
        let s = self
            .inner
            .take()
            .ok_or_else(|| raise(py, "CheckpointError", "the session is finished"))?;
        let report = crate::errors::detach_guarded(py, "finish", || s.finish(&files))?
            .map_err(|e| run_err(py, e))?;
        to_py(py, &report.to_json())
    }
}

/// The experts one MoE layer keeps (ids ascending): the `keep` best by `criterion`
/// (`reap`: reap / max(counts, 1), `frequency`: counts, `mass`, `random`: seeded by seed and
/// layer), ties to the lower id; with `n_group > 1` the same number from every group.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (counts, mass, reap, criterion, keep, n_group = 1, seed = 0, layer = 0))]
pub fn select_experts(
    py: Python<'_>,
    counts: Vec<f64>,
    mass: Vec<f64>,
    reap: Vec<f64>,
    criterion: &str,
    keep: usize,
    n_group: usize,
    seed: u64,
    layer: usize,
) -> PyResult<Vec<usize>> {
    let c = forge_run::prune::Criterion::parse(criterion).ok_or_else(|| {
        raise(
            py,
            "InvalidValueError",
            format!("invalid option criterion: expected reap, frequency, mass or random, got {criterion:?}"),
        )
    })?;
    forge_run::prune::select_experts(&counts, &mass, &reap, c, keep, n_group, seed, layer)
        .map_err(|e| run_err(py, e))
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

/// Runs the `forge-rs` command line on `argv` (program name first). Returns the exit
/// code, or `(model_dir, out_dir, options, json)` when the command asks for a calibrated
/// run, which the Python package then performs.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<String>) -> PyResult<Py<PyAny>> {
    let o = crate::errors::detach_guarded(py, "cli", || forge_run::cli::dispatch(argv))?;
    match o {
        Outcome::Exit(code) => Ok(code.into_pyobject(py)?.into_any().unbind()),
        Outcome::Calibrate {
            model_dir,
            out_dir,
            options,
            json,
        } => {
            let t = (
                model_dir.display().to_string(),
                out_dir.display().to_string(),
                to_py(py, &options)?,
                json,
            );
            Ok(t.into_pyobject(py)?.into_any().unbind())
        }
    }
}
