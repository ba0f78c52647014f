//! The orchestrator: plan, prepare the output directory, stream the model
//! unit by unit (one decoder layer at a time) through a [`LinearQuantizer`]
//! into a [`ShardWriter`], record finished units in a manifest, and finally
//! publish the index, the copied files and `config.json`.
//!
//! Crash safety: until the very end `OUT_DIR` holds only `*.partial` shards
//! and `forge-manifest.json`, never `config.json` or the index. A unit is
//! listed in the manifest only after its bytes were written and fsynced, so
//! `--resume` redoes at most the unit that was interrupted and produces the
//! same bytes as an uninterrupted run.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use forge_core::pack::AwqTensors;
use forge_io::{Checkpoint, ShardPlan, INDEX_FILE, PARTIAL_SUFFIX};
use serde_json::{json, Value};

use crate::lock::OutDirLock;
use crate::options::{Method, Options};
use crate::plan::RunPlan;
use crate::quantizer::{LayerJob, LinearJob, LinearQuantizer, RtnQuantizer};
use crate::session::Session;
use crate::{Error, Result};

/// Name of the run manifest inside `OUT_DIR` (removed when the run completes).
pub const MANIFEST_FILE: &str = "forge-manifest.json";
/// Test hook: stop with an error after this many units of one invocation.
pub const ABORT_ENV: &str = "FORGE_TEST_ABORT_AFTER_LAYERS";
/// Test hook: while publishing, stop with an error after this many shards
/// were renamed into place (the output stays resumable).
pub const ABORT_RENAMES_ENV: &str = "FORGE_TEST_ABORT_AFTER_RENAMES";
/// Set to `0` to skip the free disk space check before a run.
pub const DISK_CHECK_ENV: &str = "FORGE_DISK_CHECK";
/// Test hook: sleep this many milliseconds after each unit (to kill a run mid-way).
pub const SLOW_ENV: &str = "FORGE_TEST_UNIT_DELAY_MS";

/// Receives progress events. All methods have no-op defaults.
pub trait Progress: Sync {
    /// The run starts: `units` in total, `bytes` source bytes, of which
    /// `done_units`/`done_bytes` were finished by an earlier run.
    fn start(&self, _units: usize, _bytes: u64, _done_units: usize, _done_bytes: u64) {}
    /// A unit is finished. Return `false` to stop the run (it stays resumable).
    fn unit_done(&self, _label: &str, _bytes: u64) -> bool {
        true
    }
    /// A message worth showing (fused group pulled out, ...).
    fn note(&self, _msg: &str) {}
    /// Final shards, index and config are being written.
    fn finishing(&self) {}
}

/// Progress sink that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;
impl Progress for NoProgress {}

/// What a finished run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The output directory.
    pub out_dir: PathBuf,
    /// Detected family.
    pub arch: String,
    /// Quantizer name.
    pub quantizer: String,
    /// Quantized linears.
    pub quantized: usize,
    /// `modules_to_not_convert`.
    pub not_convert: Vec<String>,
    /// Units (layers + non-layer tensors) in the run.
    pub units: usize,
    /// Units taken over from an interrupted run.
    pub resumed_units: usize,
    /// Source tensor bytes.
    pub bytes_in: u64,
    /// Output tensor bytes.
    pub bytes_out: u64,
    /// Output shard files.
    pub shards: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Messages about decisions taken.
    pub notes: Vec<String>,
}

impl RunReport {
    /// JSON form (for Python and `--json`).
    pub fn to_json(&self) -> Value {
        json!({
            "out_dir": self.out_dir.display().to_string(),
            "arch": self.arch,
            "quantizer": self.quantizer,
            "quantized": self.quantized,
            "modules_to_not_convert": self.not_convert,
            "units": self.units,
            "resumed_units": self.resumed_units,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "shards": self.shards,
            "seconds": self.seconds,
            "notes": self.notes,
        })
    }
}

/// Quantizes `model_dir` into `out_dir` data-free (round to nearest on the
/// grid of `opts.grid`), on the CPU or `opts.device`.
pub fn quantize(
    model_dir: &Path,
    out_dir: &Path,
    opts: &Options,
    progress: &dyn Progress,
) -> Result<RunReport> {
    opts.validate()?;
    if opts.method == Method::Gptq {
        return Err(Error::options(
            "method",
            "the native run is data-free (rtn or none); method gptq runs the calibration forward in Python: use forge.quantize_model or `forge-rs quantize --method gptq` with the Python package installed",
        ));
    }
    if opts.uses_calibration() {
        let what = if opts.stats_only {
            "stats_only"
        } else {
            "expert pruning with calib"
        };
        return Err(Error::options(
            if opts.stats_only { "stats_only" } else { "calib" },
            format!("{what} runs the calibration forward in Python: use `forge-rs prune` or forge.quantize_model with the Python package installed (the native run prunes from router_stats only)"),
        ));
    }
    let grid = opts.grid_mode()?;
    match opts.cuda_device()? {
        Some(dev) => {
            let q = crate::CudaRtnQuantizer::new(grid, dev)?;
            quantize_with(model_dir, out_dir, opts, &q, progress)
        }
        None => {
            let q = RtnQuantizer { mode: grid };
            quantize_with(model_dir, out_dir, opts, &q, progress)
        }
    }
}

/// Quantizes with any [`LinearQuantizer`], on a pool of `opts.threads`.
pub fn quantize_with(
    model_dir: &Path,
    out_dir: &Path,
    opts: &Options,
    quantizer: &dyn LinearQuantizer,
    progress: &dyn Progress,
) -> Result<RunReport> {
    opts.validate()?;
    match opts.threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .map_err(|e| Error::options("threads", e.to_string()))?
            .install(|| run(model_dir, out_dir, opts, quantizer, progress)),
        None => run(model_dir, out_dir, opts, quantizer, progress),
    }
}

/// FNV-1a 64: a stable fingerprint (not a security hash).
pub(crate) fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
pub(crate) const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

pub(crate) fn source_fingerprint(ckpt: &Checkpoint) -> Result<Value> {
    let mut files = Vec::new();
    for path in ckpt.files() {
        let mut f = File::open(path).map_err(Error::io("open", path))?;
        let size = f.metadata().map_err(Error::io("stat", path))?.len();
        let mut prefix = [0u8; 8];
        f.read_exact(&mut prefix).map_err(Error::io("read", path))?;
        let n = u64::from_le_bytes(prefix).min(forge_io::MAX_HEADER_BYTES);
        let mut header = Vec::new();
        f.take(n)
            .read_to_end(&mut header)
            .map_err(Error::io("read", path))?;
        let name = path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        files.push(json!({"file": name, "size": size, "header_fnv": format!("{:016x}", fnv(&header, FNV0))}));
    }
    let cfg = ckpt.path().join("config.json");
    let cfg_fnv = match std::fs::read(&cfg) {
        Ok(b) => format!("{:016x}", fnv(&b, FNV0)),
        Err(_) => "none".into(),
    };
    Ok(json!({"files": files, "config_fnv": cfg_fnv}))
}

pub(crate) fn plan_fingerprint(plan: &RunPlan, shard_plan: Option<&ShardPlan>) -> String {
    let mut h = fnv(
        shard_plan
            .map_or_else(|| "no shards".into(), ShardPlan::index_json)
            .as_bytes(),
        FNV0,
    );
    for m in &plan.not_convert {
        h = fnv(m.as_bytes(), h);
        h = fnv(b"\n", h);
    }
    format!("{h:016x}")
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn is_ancestor(anc: &Path, p: &Path) -> bool {
    match (anc.canonicalize(), p.canonicalize()) {
        (Ok(a), Ok(p)) => p.starts_with(a),
        _ => false,
    }
}

fn dir_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.map(|e| e.path()).map_err(Error::io("list", dir)))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io("list", dir)(e)),
    }
}

/// State of `OUT_DIR` before the run.
pub(crate) enum Start {
    Fresh(OutDirLock),
    Resume {
        lock: OutDirLock,
        done: Vec<String>,
        state: Option<(String, String)>,
        /// The interrupted run had begun publishing its shards.
        finishing: bool,
        /// Expert bindings (MoE layer, kept ids) recorded by the interrupted run.
        experts: Vec<(usize, Vec<usize>)>,
    },
}

pub(crate) fn prepare_out_dir(
    model_dir: &Path,
    out_dir: &Path,
    resume: bool,
    overwrite: bool,
    manifest_base: &Value,
) -> Result<Start> {
    let err = |reason: &str| Error::OutDir {
        dir: out_dir.into(),
        reason: reason.into(),
    };
    if out_dir.exists() && !out_dir.is_dir() {
        return Err(err("exists and is not a directory"));
    }
    if same_dir(model_dir, out_dir) || is_ancestor(out_dir, model_dir) {
        return Err(err(
            "is the model directory or contains it; choose another directory",
        ));
    }
    std::fs::create_dir_all(out_dir).map_err(Error::io("create directory", out_dir))?;
    // Exclusive for the whole run: a second run into the same folder is refused.
    let lock = OutDirLock::acquire(out_dir)?;
    let entries: Vec<PathBuf> = dir_entries(out_dir)?
        .into_iter()
        .filter(|p| !crate::lock::is_lock_file(p))
        .collect();
    if entries.is_empty() {
        return Ok(Start::Fresh(lock));
    }
    let manifest_path = out_dir.join(MANIFEST_FILE);
    if resume && !overwrite {
        let text = match std::fs::read_to_string(&manifest_path) {
            Ok(t) => t,
            Err(_) => {
                let reason = if out_dir.join("config.json").is_file()
                    && out_dir.join(INDEX_FILE).is_file()
                {
                    format!("it holds a finished checkpoint (no {MANIFEST_FILE}); nothing to resume, use --overwrite to start over")
                } else {
                    format!("no {MANIFEST_FILE}: the directory was not written by an interrupted forge run; use --overwrite to start over")
                };
                return Err(Error::Resume {
                    dir: out_dir.into(),
                    reason,
                });
            }
        };
        let m: Value = serde_json::from_str(&text).map_err(|e| Error::Resume {
            dir: out_dir.into(),
            reason: format!("{MANIFEST_FILE} is unreadable ({e}); use --overwrite to start over"),
        })?;
        for key in [
            "format",
            "version",
            "quantizer",
            "options",
            "calibration",
            "source",
            "plan",
        ] {
            if m.get(key) != manifest_base.get(key) {
                return Err(Error::Resume {
                    dir: out_dir.into(),
                    reason: format!(
                        "the interrupted run used a different {key} (recorded {}, now {}); rerun with the same options and source, or use --overwrite",
                        short(m.get(key)),
                        short(manifest_base.get(key))
                    ),
                });
            }
        }
        let done = m
            .get("done")
            .and_then(Value::as_array)
            .map(|v| {
                v.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let state = m.get("state").and_then(|s| {
            Some((
                s.get("unit")?.as_str()?.to_owned(),
                s.get("file")?.as_str()?.to_owned(),
            ))
        });
        let finishing = m.get("finishing").is_some_and(Value::is_object);
        let mut experts = Vec::new();
        if let Some(map) = m.get("experts").and_then(Value::as_object) {
            for (layer, ids) in map {
                let parsed = layer
                    .parse::<usize>()
                    .ok()
                    .zip(ids.as_array().and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                            .collect::<Option<Vec<usize>>>()
                    }));
                let Some(entry) = parsed else {
                    return Err(Error::Resume {
                        dir: out_dir.into(),
                        reason: format!("{MANIFEST_FILE}: experts entry {layer:?} is not a layer and a list of ids; use --overwrite to start over"),
                    });
                };
                experts.push(entry);
            }
        }
        return Ok(Start::Resume {
            lock,
            done,
            state,
            finishing,
            experts,
        });
    }
    if !overwrite {
        return Err(err("is not empty; pass --overwrite to replace its files, or --resume to continue an interrupted run"));
    }
    // Only what forge writes is removed; anything else stops the run.
    let foreign: Vec<String> = entries
        .iter()
        .filter(|p| !is_forge_output(model_dir, p))
        .map(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            if p.is_dir() {
                format!("{name}/")
            } else {
                name.into_owned()
            }
        })
        .collect();
    if !foreign.is_empty() {
        let mut sorted = foreign;
        sorted.sort();
        let shown: Vec<&str> = sorted.iter().take(5).map(String::as_str).collect();
        let more = if sorted.len() > 5 {
            format!(" and {} more", sorted.len() - 5)
        } else {
            String::new()
        };
        return Err(err(&format!(
            "--overwrite removes only files forge writes, and this folder holds {} other(s): {}{more}; move them away or choose another folder",
            sorted.len(),
            shown.join(", ")
        )));
    }
    for p in entries {
        let meta = std::fs::symlink_metadata(&p).map_err(Error::io("stat", &p))?;
        if meta.is_dir() {
            std::fs::remove_dir_all(&p).map_err(Error::io("remove", &p))?;
        } else {
            std::fs::remove_file(&p).map_err(Error::io("remove", &p))?;
        }
    }
    Ok(Start::Fresh(lock))
}

/// Whether `path` (an entry of the output folder) is something a forge run
/// writes: shards, index, config, manifest, `.partial` files, the `forge/`
/// and `forge-state/` folders, or a side file copied from the model folder.
fn is_forge_output(model_dir: &Path, path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|s| s.to_str()) else {
        return false;
    };
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return false;
    };
    if meta.is_dir() {
        return name == crate::session::REPORT_DIR || name == crate::session::STATE_DIR;
    }
    if !meta.is_file() {
        return false;
    }
    if is_shard_name(name)
        || name == INDEX_FILE
        || name == "config.json"
        || name == MANIFEST_FILE
        || name.ends_with(PARTIAL_SUFFIX)
    {
        return true;
    }
    // A side file copied from the model folder (the same name, copied again by this run).
    !name.starts_with('.') && !is_weight_file(name) && model_dir.join(name).is_file()
}

/// `model-<digits>-of-<digits>.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    rest.split_once("-of-")
        .is_some_and(|(a, b)| digits(a) && digits(b))
}

fn short(v: Option<&Value>) -> String {
    let s = v.map_or_else(|| "nothing".into(), Value::to_string);
    if s.len() > 120 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(117).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = PathBuf::from(format!("{}{PARTIAL_SUFFIX}", path.display()));
    {
        let mut f = File::create(&tmp).map_err(Error::io("create", &tmp))?;
        std::io::Write::write_all(&mut f, bytes).map_err(Error::io("write", &tmp))?;
        f.sync_all().map_err(Error::io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(Error::io("rename", &tmp))
}

pub(crate) fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// File names (extensions) never copied from the model directory.
fn is_weight_file(name: &str) -> bool {
    const EXT: &[&str] = &[
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".gguf",
        ".onnx",
        ".index.json",
    ];
    EXT.iter().any(|e| name.ends_with(e)) || name.ends_with(PARTIAL_SUFFIX)
}

pub(crate) fn copy_side_files(
    model_dir: &Path,
    out_dir: &Path,
    notes: &mut Vec<String>,
) -> Result<()> {
    let mut names: Vec<PathBuf> = dir_entries(model_dir)?;
    names.sort();
    for src in names {
        let Some(name) = src.file_name().and_then(|s| s.to_str()).map(str::to_owned) else {
            continue;
        };
        if name.starts_with('.')
            || name == "config.json"
            || name == MANIFEST_FILE
            || is_weight_file(&name)
        {
            continue;
        }
        let meta = std::fs::metadata(&src).map_err(Error::io("stat", &src))?;
        if !meta.is_dir() && !meta.is_file() {
            notes.push(format!(
                "{name} in the model directory is not a regular file (a pipe, socket or device); not copied"
            ));
            continue;
        }
        if meta.is_dir() {
            notes.push(format!(
                "subdirectory {name}/ of the model directory was not copied"
            ));
            continue;
        }
        let dst = out_dir.join(&name);
        std::fs::copy(&src, &dst).map_err(Error::io("copy", &src))?;
    }
    Ok(())
}

fn run(
    model_dir: &Path,
    out_dir: &Path,
    opts: &Options,
    quantizer: &dyn LinearQuantizer,
    progress: &dyn Progress,
) -> Result<RunReport> {
    let mut session = Session::open(model_dir, out_dir, opts)?;
    for n in &session.plan().notes {
        progress.note(n);
    }
    let units = session.plan().units.len();
    let total_bytes: u64 = session.plan().units.iter().map(|u| u.bytes_in).sum();
    let (resumed, resumed_bytes) = session.resumed();
    progress.start(units, total_bytes, resumed, resumed_bytes);
    let abort_after = env_usize(ABORT_ENV);
    let delay = env_usize(SLOW_ENV);
    let spec = session.options().quant()?.grid_spec();
    let mut processed = 0usize;
    for i in 0..units {
        if session.is_done(i) {
            continue;
        }
        session.write_unquantized(i)?;
        quantize_unit(&session, i, quantizer, spec)?;
        session.commit(i, None)?;
        processed += 1;
        if let Some(ms) = delay {
            std::thread::sleep(std::time::Duration::from_millis(ms as u64));
        }
        let u = session.unit(i)?;
        if !progress.unit_done(&u.label, u.bytes_in) {
            return Err(Error::Interrupted);
        }
        if abort_after.is_some_and(|n| processed >= n) {
            return Err(Error::TestAbort { units: processed });
        }
    }
    progress.finishing();
    session.finish(&[])
}

pub(crate) fn quantize_unit(
    session: &Session,
    i: usize,
    quantizer: &dyn LinearQuantizer,
    spec: forge_core::GridSpec,
) -> Result<()> {
    let u = session.unit(i)?;
    if u.linears.is_empty() {
        return Ok(());
    }
    let ckpt = session.checkpoint();
    let linears = u
        .linears
        .iter()
        .map(|l| {
            Ok(LinearJob {
                module: &l.module,
                weight: ckpt.tensor(&l.weight)?,
                n: l.n,
                k: l.k,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let job = LayerJob {
        label: &u.label,
        layer: u.layer,
        checkpoint: ckpt,
        linears,
        spec,
    };
    let sink = |j: usize, t: AwqTensors| session.write_awq(job.linears[j].module, &t);
    quantizer.quantize_layer(&job, &sink)
}
