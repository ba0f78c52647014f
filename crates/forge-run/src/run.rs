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

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use forge_core::pack::AwqTensors;
use forge_io::{Checkpoint, ShardPlan, ShardWriter, INDEX_FILE, PARTIAL_SUFFIX};
use serde_json::{json, Value};

use crate::plan::{self, Action, QuantOptions, RunPlan, Unit};
use crate::quantizer::{LayerJob, LinearJob, LinearQuantizer, RtnQuantizer};
use crate::{Error, Result};

/// Name of the run manifest inside `OUT_DIR` (removed when the run completes).
pub const MANIFEST_FILE: &str = "forge-manifest.json";
/// Test hook: stop with an error after this many units of one invocation.
pub const ABORT_ENV: &str = "FORGE_TEST_ABORT_AFTER_LAYERS";
/// Test hook: sleep this many milliseconds after each unit (to kill a run mid-way).
pub const SLOW_ENV: &str = "FORGE_TEST_UNIT_DELAY_MS";
const MANIFEST_FORMAT: &str = "4bit-forge run manifest v1";

/// Options of a run that do not change the output bytes, plus the output ones.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// What to quantize and how.
    pub quant: QuantOptions,
    /// Continue an interrupted run recorded in `OUT_DIR`'s manifest.
    pub resume: bool,
    /// Replace the files of a non-empty `OUT_DIR`.
    pub overwrite: bool,
    /// Worker threads (`None`: all cores).
    pub threads: Option<usize>,
    /// Quantize on this CUDA device instead of the CPU (same output bytes).
    pub cuda_device: Option<usize>,
}

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

/// Quantizes `model_dir` into `out_dir` with round to nearest on the grid of
/// `opts.quant.grid`.
pub fn quantize(
    model_dir: &Path,
    out_dir: &Path,
    opts: &RunOptions,
    progress: &dyn Progress,
) -> Result<RunReport> {
    match opts.cuda_device {
        Some(dev) => {
            let q = crate::CudaRtnQuantizer::new(opts.quant.grid, dev)?;
            quantize_with(model_dir, out_dir, opts, &q, progress)
        }
        None => {
            let q = RtnQuantizer {
                mode: opts.quant.grid,
            };
            quantize_with(model_dir, out_dir, opts, &q, progress)
        }
    }
}

/// Quantizes with any [`LinearQuantizer`], on a pool of `opts.threads`.
pub fn quantize_with(
    model_dir: &Path,
    out_dir: &Path,
    opts: &RunOptions,
    quantizer: &dyn LinearQuantizer,
    progress: &dyn Progress,
) -> Result<RunReport> {
    match opts.threads {
        Some(0) => Err(Error::options("threads", "must be at least 1")),
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
const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

fn source_fingerprint(ckpt: &Checkpoint) -> Result<Value> {
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

fn plan_fingerprint(plan: &RunPlan, shard_plan: &ShardPlan) -> String {
    let mut h = fnv(shard_plan.index_json().as_bytes(), FNV0);
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
enum Start {
    Fresh,
    Resume(Vec<String>),
}

fn prepare_out_dir(
    model_dir: &Path,
    out_dir: &Path,
    opts: &RunOptions,
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
    let entries = dir_entries(out_dir)?;
    if entries.is_empty() {
        std::fs::create_dir_all(out_dir).map_err(Error::io("create directory", out_dir))?;
        return Ok(Start::Fresh);
    }
    let manifest_path = out_dir.join(MANIFEST_FILE);
    if opts.resume && !opts.overwrite {
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
        return Ok(Start::Resume(done));
    }
    if !opts.overwrite {
        return Err(err("is not empty; pass --overwrite to replace its files, or --resume to continue an interrupted run"));
    }
    for p in entries {
        let meta = std::fs::symlink_metadata(&p).map_err(Error::io("stat", &p))?;
        if meta.is_dir() {
            continue;
        }
        std::fs::remove_file(&p).map_err(Error::io("remove", &p))?;
    }
    Ok(Start::Fresh)
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

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = PathBuf::from(format!("{}{PARTIAL_SUFFIX}", path.display()));
    {
        let mut f = File::create(&tmp).map_err(Error::io("create", &tmp))?;
        std::io::Write::write_all(&mut f, bytes).map_err(Error::io("write", &tmp))?;
        f.sync_all().map_err(Error::io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(Error::io("rename", &tmp))
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// The `quantization_config` written to config.json.
pub fn awq_config(opts: &QuantOptions, not_convert: &[String]) -> Value {
    json!({
        "quant_method": "awq",
        "bits": 4,
        "group_size": opts.group_size,
        "zero_point": true,
        "version": "gemm",
        "modules_to_not_convert": not_convert,
    })
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

fn copy_side_files(model_dir: &Path, out_dir: &Path, notes: &mut Vec<String>) -> Result<()> {
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
    opts: &RunOptions,
    quantizer: &dyn LinearQuantizer,
    progress: &dyn Progress,
) -> Result<RunReport> {
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(model_dir)?;
    let config = plan::read_config(model_dir)?;
    let plan = plan::build(&ckpt, &config, &opts.quant)?;
    let shard_plan = ShardPlan::new(plan.specs.iter().cloned(), opts.quant.max_shard_bytes)?;
    let mut notes = plan.notes.clone();
    for n in &notes {
        progress.note(n);
    }

    let manifest_base = json!({
        "format": MANIFEST_FORMAT,
        "version": env!("CARGO_PKG_VERSION"),
        "quantizer": quantizer.name(),
        "options": opts.quant.to_json(),
        "source": source_fingerprint(&ckpt)?,
        "plan": plan_fingerprint(&plan, &shard_plan),
    });
    let start = prepare_out_dir(model_dir, out_dir, opts, &manifest_base)?;
    let (writer, mut done): (ShardWriter, BTreeSet<String>) = match start {
        Start::Fresh => (
            ShardWriter::create(out_dir, shard_plan, &Default::default())?,
            BTreeSet::new(),
        ),
        Start::Resume(done) => (
            ShardWriter::create_or_reopen(out_dir, shard_plan, &Default::default())?,
            done.into_iter().collect(),
        ),
    };
    let file_of: HashMap<&str, &str> = writer
        .plan()
        .shards()
        .iter()
        .flat_map(|s| {
            s.tensors
                .iter()
                .map(move |t| (t.spec.name.as_str(), s.file_name.as_str()))
        })
        .collect();
    let reopened: BTreeSet<&str> = writer.reopened_files().into_iter().collect();

    // Take over the finished units whose shards survived intact.
    let mut resumed = 0usize;
    let mut resumed_bytes = 0u64;
    for u in &plan.units {
        if !done.contains(&u.key) {
            continue;
        }
        if u.outputs.iter().all(|o| {
            file_of
                .get(o.as_str())
                .is_some_and(|f| reopened.contains(f))
        }) {
            for o in &u.outputs {
                writer.mark_written(o)?;
            }
            resumed += 1;
            resumed_bytes += u.bytes_in;
        } else {
            done.remove(&u.key);
        }
    }
    let manifest_path = out_dir.join(MANIFEST_FILE);
    let save_manifest = |done: &BTreeSet<String>| -> Result<()> {
        let mut m = manifest_base.clone();
        m["done"] = json!(done);
        let text = serde_json::to_string_pretty(&m).unwrap_or_default() + "\n";
        write_atomic(&manifest_path, text.as_bytes())
    };
    save_manifest(&done)?;

    let total_bytes: u64 = plan.units.iter().map(|u| u.bytes_in).sum();
    progress.start(plan.units.len(), total_bytes, resumed, resumed_bytes);
    let abort_after = env_usize(ABORT_ENV);
    let delay = env_usize(SLOW_ENV);
    let spec = opts.quant.grid_spec();
    let mut processed = 0usize;
    for u in &plan.units {
        if done.contains(&u.key) {
            continue;
        }
        process_unit(&ckpt, u, &writer, quantizer, spec)?;
        // Keep resident memory at about one layer: drop this unit's source pages.
        ckpt.release(u.tensors.iter().map(|(name, _)| name.as_str()));
        // Durable before it is recorded.
        let files: BTreeSet<&str> = u
            .outputs
            .iter()
            .filter_map(|o| file_of.get(o.as_str()).copied())
            .collect();
        for f in files {
            let p = out_dir.join(format!("{f}{PARTIAL_SUFFIX}"));
            File::open(&p)
                .and_then(|h| h.sync_data())
                .map_err(Error::io("fsync", &p))?;
        }
        done.insert(u.key.clone());
        save_manifest(&done)?;
        processed += 1;
        if let Some(ms) = delay {
            std::thread::sleep(std::time::Duration::from_millis(ms as u64));
        }
        if !progress.unit_done(&u.label, u.bytes_in) {
            return Err(Error::Interrupted);
        }
        if abort_after.is_some_and(|n| processed >= n) {
            return Err(Error::TestAbort { units: processed });
        }
    }

    progress.finishing();
    let n_shards = writer.plan().shards().len();
    let bytes_out = writer.plan().total_bytes();
    writer.finish()?;
    copy_side_files(model_dir, out_dir, &mut notes)?;
    let mut cfg = if config.is_object() {
        config.clone()
    } else {
        notes.push(
            "the model directory has no config.json; wrote one holding only quantization_config"
                .into(),
        );
        json!({})
    };
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("quantization_config");
        obj.remove("compression_config");
        obj.insert(
            "quantization_config".into(),
            awq_config(&opts.quant, &plan.not_convert),
        );
    }
    let text = serde_json::to_string_pretty(&cfg).unwrap_or_default() + "\n";
    write_atomic(&out_dir.join("config.json"), text.as_bytes())?;
    std::fs::remove_file(&manifest_path).map_err(Error::io("remove", &manifest_path))?;
    Ok(RunReport {
        out_dir: out_dir.into(),
        arch: plan.arch.name.into(),
        quantizer: quantizer.name(),
        quantized: plan.n_quantized(),
        not_convert: plan.not_convert.clone(),
        units: plan.units.len(),
        resumed_units: resumed,
        bytes_in: total_bytes,
        bytes_out,
        shards: n_shards,
        seconds: t0.elapsed().as_secs_f64(),
        notes,
    })
}

fn write_awq(writer: &ShardWriter, module: &str, t: &AwqTensors) -> Result<()> {
    writer.write_tensor(&format!("{module}.qweight"), &le_bytes_i32(&t.qweight))?;
    writer.write_tensor(&format!("{module}.qzeros"), &le_bytes_i32(&t.qzeros))?;
    let scales: Vec<u8> = t.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    writer.write_tensor(&format!("{module}.scales"), &scales)?;
    Ok(())
}

fn le_bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn process_unit(
    ckpt: &Checkpoint,
    u: &Unit,
    writer: &ShardWriter,
    quantizer: &dyn LinearQuantizer,
    spec: forge_core::GridSpec,
) -> Result<()> {
    use rayon::prelude::*;
    // Unquantized tensors: byte copies straight from the mmap, FP8 → bf16.
    u.tensors
        .par_iter()
        .try_for_each(|(name, action)| -> Result<()> {
            match action {
                Action::Copy => writer.write_tensor(name, ckpt.tensor(name)?.bytes)?,
                Action::ToBf16 => {
                    let v = ckpt.dequantized_f32(name)?;
                    let b: Vec<u8> = v
                        .iter()
                        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                        .collect();
                    writer.write_tensor(name, &b)?;
                }
                Action::Quantize(_) | Action::Drop => {}
            }
            Ok(())
        })?;
    if u.linears.is_empty() {
        return Ok(());
    }
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
    let sink = |i: usize, t: AwqTensors| write_awq(writer, job.linears[i].module, &t);
    quantizer.quantize_layer(&job, &sink)?;
    // Every linear must have reached the sink.
    for l in &u.linears {
        if !writer.is_written(&format!("{}.scales", l.module)) {
            return Err(Error::Quantizer {
                quantizer: quantizer.name(),
                reason: format!("{}: {} was never produced", u.label, l.module),
            });
        }
    }
    Ok(())
}
