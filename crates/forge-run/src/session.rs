//! A quantization run as a session that its caller drives unit by unit.
//!
//! The session owns everything on disk: it reads and plans the checkpoint,
//! prepares (or resumes) the output folder, writes every tensor at its
//! planned offset, records finished units in the resume manifest and
//! publishes the result. The caller owns the order of work and the maths: the
//! data-free run ([`crate::run`]) is a short loop in Rust, the calibrated GPTQ
//! run is a loop in Python (`forge.calibrate`), shaped like the GPTQ
//! reference's `opt_sequential`:
//!
//! ```text
//! open → for unit in units (non-layer tensors first, then layers in order):
//!            skip if done ─ read the unit's tensors (zero-copy)
//!            write_unquantized ─ write_linear / write_awq for each planned linear
//!            [write the caller's state file] ─ commit
//!      → finish
//! ```
//!
//! A unit is recorded only after its bytes are fsynced; the caller's state
//! file (the calibration activations entering the next layer) is recorded
//! with it. The caller may skip the state at some layers (it can be tens of
//! GB): a resumed run restarts from the last layer that has one and redoes the
//! layers after it.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use forge_core::pack::AwqTensors;
use forge_core::QMeta;
use forge_io::{Checkpoint, ShardPlan, ShardWriter, PARTIAL_SUFFIX};
use serde_json::{json, Value};

use crate::lock::OutDirLock;
use crate::options::{Method, Options};
use crate::plan::{self, Action, RunPlan, Unit};
use crate::prune::{Layout, PruneSpec};
use crate::run::{
    copy_side_files, env_usize, fnv, prepare_out_dir, source_fingerprint, write_atomic, Start,
    ABORT_RENAMES_ENV, DISK_CHECK_ENV, FNV0, MANIFEST_FILE,
};
use crate::{Error, Result, RunReport};

const MANIFEST_FORMAT: &str = "4bit-forge run manifest v2";
/// Folder inside the output folder holding reports and router statistics
/// (kept apart so that no loader takes `router_stats.safetensors` for a shard).
pub const REPORT_DIR: &str = "forge";
/// Folder inside the output folder holding the caller's resume state.
pub const STATE_DIR: &str = "forge-state";

/// An open run. See the module documentation.
pub struct Session {
    ckpt: Arc<Checkpoint>,
    config: Value,
    plan: RunPlan,
    opts: Options,
    model_dir: PathBuf,
    out_dir: PathBuf,
    /// `None` when the run writes no tensor (stats_only).
    writer: Option<ShardWriter>,
    manifest_base: Value,
    done: BTreeSet<String>,
    state: Option<(String, String)>,
    /// Publication has begun: the shards already renamed into place.
    finishing: Option<BTreeSet<String>>,
    file_of: HashMap<String, String>,
    prune: Option<PruneSpec>,
    /// Module → (unit, index into its linears).
    linear_of: HashMap<String, (usize, usize)>,
    notes: Vec<String>,
    resumed: usize,
    resumed_bytes: u64,
    /// Units whose bytes (and state file) a [`UnitSync`] has made durable.
    synced: Arc<std::sync::Mutex<HashMap<usize, Option<PathBuf>>>>,
    t0: Instant,
    _lock: OutDirLock,
}

fn calib_fingerprint(opts: &Options) -> Result<Value> {
    if !opts.uses_calibration() {
        return Ok(Value::Null);
    }
    let Some(path) = &opts.calib else {
        let why = if opts.method == Method::Gptq {
            "method gptq"
        } else if opts.stats_only {
            "stats_only"
        } else {
            "expert pruning without router_stats"
        };
        return Err(Error::options(
            "calib",
            format!("a calibration file is required for {why} (plain text, .jsonl with a \"text\" field, or token ids in .json/.pt)"),
        ));
    };
    let meta = std::fs::metadata(path).map_err(Error::io("open calibration file", path))?;
    if !meta.is_file() {
        return Err(Error::options(
            "calib",
            format!("{} is not a regular file", path.display()),
        ));
    }
    if meta.len() == 0 {
        return Err(Error::options(
            "calib",
            format!("{} is empty", path.display()),
        ));
    }
    let mut f = File::open(path).map_err(Error::io("open calibration file", path))?;
    let mut h = FNV0;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(Error::io("read calibration file", path))?;
        if n == 0 {
            break;
        }
        h = fnv(&buf[..n], h);
    }
    Ok(json!({"size": meta.len(), "fnv": format!("{h:016x}")}))
}

impl Session {
    /// Opens a run: validates the options, plans every tensor, and prepares the
    /// output folder (fresh, or resumed from its manifest when `opts.resume`).
    pub fn open(model_dir: &Path, out_dir: &Path, opts: &Options) -> Result<Session> {
        opts.validate()?;
        let t0 = Instant::now();
        let ckpt = Checkpoint::open(model_dir)?;
        let config = plan::read_config(model_dir)?;
        let quant = opts.quant()?;
        let arch = crate::arch::Architecture::detect(&config);
        let prune = crate::prune::resolve(
            opts,
            &config,
            &arch,
            &plan::moe_layers(&ckpt, &config),
            &model_dir.join("config.json"),
        )?;
        let plan = plan::build_with(&ckpt, &config, &quant, prune.as_ref())?;
        let shard_plan = if plan.specs.is_empty() {
            None
        } else {
            Some(ShardPlan::new(
                plan.specs.iter().cloned(),
                quant.max_shard_bytes,
            )?)
        };
        let calib = calib_fingerprint(opts)?;
        let manifest_base = json!({
            "format": MANIFEST_FORMAT,
            "version": env!("CARGO_PKG_VERSION"),
            "quantizer": opts.quantizer_name(),
            "options": opts.fingerprint(),
            "calibration": calib,
            "source": source_fingerprint(&ckpt)?,
            "plan": crate::run::plan_fingerprint(&plan, shard_plan.as_ref()),
        });
        let start = prepare_out_dir(
            model_dir,
            out_dir,
            opts.resume,
            opts.overwrite,
            &manifest_base,
        )?;
        if let Some(sp) = &shard_plan {
            check_free_space(out_dir, sp)?;
        }
        let (lock, fresh, mut done, state, finishing, bound) = match start {
            Start::Fresh(lock) => (lock, true, BTreeSet::new(), None, false, Vec::new()),
            Start::Resume {
                lock,
                done,
                state,
                finishing,
                experts,
            } => (
                lock,
                false,
                done.into_iter().collect(),
                state,
                finishing,
                experts,
            ),
        };
        let writer = match shard_plan {
            None => None,
            Some(sp) if fresh => Some(ShardWriter::create(out_dir, sp, &Default::default())?),
            // Shards renamed by the interrupted publication are taken as written.
            Some(sp) if finishing => Some(ShardWriter::reopen_publishing(
                out_dir,
                sp,
                &Default::default(),
            )?),
            Some(sp) => Some(ShardWriter::create_or_reopen(
                out_dir,
                sp,
                &Default::default(),
            )?),
        };
        let file_of: HashMap<String, String> = writer
            .iter()
            .flat_map(|w| w.plan().shards().iter())
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |t| (t.spec.name.clone(), s.file_name.clone()))
            })
            .collect();
        let reopened: BTreeSet<String> = writer
            .iter()
            .flat_map(|w| w.reopened_files())
            .map(str::to_owned)
            .collect();
        let mut plan = plan;
        // Expert bindings recorded by the interrupted run.
        for (layer, ids) in bound {
            bind_in_plan(&mut plan, prune.as_ref(), layer, &ids).map_err(|e| Error::Resume {
                dir: out_dir.into(),
                reason: format!("the manifest's expert binding of layer {layer} does not fit this run: {e}; use --overwrite"),
            })?;
        }
        // Take over the finished units whose shards survived intact, in order: a
        // unit whose bytes are lost ends the resumable prefix (later layers depend on it).
        let mut resumed = 0usize;
        let mut resumed_bytes = 0u64;
        let mut intact = true;
        for u in &plan.units {
            if !done.contains(&u.key) {
                if u.layer.is_some() {
                    intact = false;
                }
                continue;
            }
            let ok = u.outputs.iter().all(|o| {
                file_of
                    .get(o.as_str())
                    .is_some_and(|f| reopened.contains(f))
            });
            let bound = u.experts.as_ref().is_none_or(|x| x.source.is_some());
            let keep = ok && bound && (intact || !opts.uses_calibration() || u.layer.is_none());
            if keep {
                resumed += 1;
                resumed_bytes += u.bytes_in;
            } else {
                done.remove(&u.key);
                if u.layer.is_some() {
                    intact = false;
                }
            }
        }
        // The caller's state is usable only if it belongs to a layer of the finished
        // prefix; the layers after it are redone from its activations (the caller may
        // save them only every few layers), all of them when there is no state.
        let state = state.filter(|(key, file)| {
            done.contains(key) && out_dir.join(STATE_DIR).join(file).is_file()
        });
        if opts.uses_calibration() {
            let upto = state
                .as_ref()
                .and_then(|(key, _)| plan.units.iter().position(|u| &u.key == key));
            for (pos, u) in plan.units.iter().enumerate() {
                if u.layer.is_some() && upto.is_none_or(|p| pos > p) && done.remove(&u.key) {
                    resumed -= 1;
                    resumed_bytes -= u.bytes_in;
                }
            }
        }
        // Only now (the redo decision taken): the surviving units' outputs are written.
        if let Some(w) = &writer {
            for u in plan.units.iter().filter(|u| done.contains(&u.key)) {
                for o in &u.outputs {
                    w.mark_written(o)?;
                }
            }
        }
        let linear_of = plan
            .units
            .iter()
            .enumerate()
            .flat_map(|(ui, u)| {
                u.linears
                    .iter()
                    .enumerate()
                    .map(move |(li, l)| (l.module.clone(), (ui, li)))
            })
            .collect();
        let finishing = finishing.then(|| {
            writer
                .iter()
                .flat_map(|w| w.published_files())
                .map(str::to_owned)
                .collect()
        });
        let s = Session {
            ckpt: Arc::new(ckpt),
            linear_of,
            config,
            notes: plan.notes.clone(),
            plan,
            opts: opts.clone(),
            model_dir: model_dir.into(),
            out_dir: out_dir.into(),
            writer,
            manifest_base,
            done,
            state,
            finishing,
            file_of,
            prune,
            resumed,
            resumed_bytes,
            synced: Default::default(),
            t0,
            _lock: lock,
        };
        s.save_manifest()?;
        Ok(s)
    }

    fn save_manifest(&self) -> Result<()> {
        let mut m = self.manifest_base.clone();
        m["done"] = json!(self.done);
        m["state"] = match &self.state {
            Some((unit, file)) => json!({"unit": unit, "file": file}),
            None => Value::Null,
        };
        if let Some(renamed) = &self.finishing {
            m["finishing"] = json!({ "renamed": renamed });
        }
        let experts: serde_json::Map<String, Value> = self
            .plan
            .units
            .iter()
            .filter_map(|u| {
                let ids = u.experts.as_ref()?.source.as_ref()?;
                Some((u.layer?.to_string(), json!(ids)))
            })
            .collect();
        if !experts.is_empty() {
            m["experts"] = Value::Object(experts);
        }
        let text = serde_json::to_string_pretty(&m).unwrap_or_default() + "\n";
        write_atomic(&self.out_dir.join(MANIFEST_FILE), text.as_bytes())
    }

    /// The source checkpoint (zero-copy tensor views).
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    /// A shared handle on the source checkpoint (keeps its maps alive for
    /// zero-copy views handed to another language).
    pub fn checkpoint_arc(&self) -> Arc<Checkpoint> {
        Arc::clone(&self.ckpt)
    }

    /// The plan: units in processing order (non-layer tensors first).
    pub fn plan(&self) -> &RunPlan {
        &self.plan
    }

    /// The source `config.json` (`Null` when absent).
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// The validated options.
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The output folder.
    pub fn out_dir(&self) -> &Path {
        &self.out_dir
    }

    /// Whether unit `i` is finished (by this run or the interrupted one).
    pub fn is_done(&self, i: usize) -> bool {
        self.plan
            .units
            .get(i)
            .is_some_and(|u| self.done.contains(&u.key))
    }

    /// Units finished by an earlier run, and their source bytes.
    pub fn resumed(&self) -> (usize, u64) {
        (self.resumed, self.resumed_bytes)
    }

    /// The caller's resume state: `(unit key, path)` of the state file recorded
    /// with the last finished layer, if any.
    pub fn resume_state(&self) -> Option<(String, PathBuf)> {
        self.state
            .as_ref()
            .map(|(k, f)| (k.clone(), self.out_dir.join(STATE_DIR).join(f)))
    }

    /// Where the caller writes the state to record with unit `i`'s commit
    /// (the folder is created).
    pub fn state_path(&self, i: usize) -> Result<PathBuf> {
        let u = self.unit(i)?;
        let dir = self.out_dir.join(STATE_DIR);
        std::fs::create_dir_all(&dir).map_err(Error::io("create directory", &dir))?;
        Ok(dir.join(format!("{}.safetensors", u.key)))
    }

    /// Reads unit `i`'s source tensors ahead on a background thread (a hint to the kernel,
    /// see [`Checkpoint::prefetch`]), so that a cold read overlaps the current unit's work.
    pub fn prefetch(&self, i: usize) -> Result<()> {
        let names: Vec<String> = self
            .unit(i)?
            .tensors
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        let ckpt = Arc::clone(&self.ckpt);
        std::thread::Builder::new()
            .name("forge-prefetch".into())
            .spawn(move || ckpt.prefetch(names.iter().map(String::as_str)))
            .map_err(Error::io("start the read-ahead thread", &self.out_dir))?;
        Ok(())
    }

    /// Unit `i`.
    pub fn unit(&self, i: usize) -> Result<&Unit> {
        self.plan.units.get(i).ok_or_else(|| {
            Error::options(
                "unit",
                format!("no unit {i} (the plan has {})", self.plan.units.len()),
            )
        })
    }

    /// Writes unit `i`'s unquantized tensors (byte copies; FP8 → bf16).
    pub fn write_unquantized(&self, i: usize) -> Result<()> {
        use rayon::prelude::*;
        let u = self.unit(i)?;
        self.check_bound(u)?;
        // (output name, source name, action): the unit's own tensors, then the
        // unquantized tensors of the kept experts under their compact slots.
        let mut jobs: Vec<(String, String, Action)> = u
            .tensors
            .iter()
            .map(|(n, a)| (n.clone(), n.clone(), *a))
            .collect();
        if let Some(x) = &u.experts {
            for c in 0..x.keep {
                for (leaf, a) in &x.leaves {
                    if let (Action::Copy | Action::ToBf16, Some(src)) = (a, x.source_of(c, leaf)) {
                        jobs.push((format!("{}{c}.{leaf}", x.prefix), src, *a));
                    }
                }
            }
        }
        let keep_ids: &[usize] = u
            .experts
            .as_ref()
            .and_then(|x| x.source.as_deref())
            .unwrap_or_default();
        jobs.par_iter()
            .try_for_each(|(out, src, action)| -> Result<()> {
                match action {
                    Action::Copy => self.w()?.write_tensor(out, self.ckpt.tensor(src)?.bytes)?,
                    Action::ToBf16 => {
                        let v = self.ckpt.dequantized_f32(src)?;
                        self.w()?.write_tensor(out, &bf16_bytes(&v))?;
                    }
                    Action::SliceRows => {
                        let t = self.ckpt.tensor(src)?;
                        let rows = t.shape.first().copied().unwrap_or(1).max(1);
                        let b = if t.dtype == forge_io::Dtype::F8_E4M3 {
                            let v = self.ckpt.dequantized_f32(src)?;
                            let w = v.len() / rows;
                            let sel: Vec<f32> = keep_ids
                                .iter()
                                .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
                                .collect();
                            bf16_bytes(&sel)
                        } else {
                            let w = t.bytes.len() / rows;
                            keep_ids
                                .iter()
                                .flat_map(|&r| t.bytes[r * w..(r + 1) * w].iter().copied())
                                .collect()
                        };
                        self.w()?.write_tensor(out, &b)?;
                    }
                    Action::Quantize(_) | Action::Drop | Action::Expert => {}
                }
                Ok(())
            })
    }

    fn w(&self) -> Result<&ShardWriter> {
        self.writer.as_ref().ok_or_else(|| {
            Error::options(
                "stats_only",
                "this run writes no tensor (router statistics only)",
            )
        })
    }

    /// Fails when unit `u` is a pruned layer whose kept experts are not bound yet.
    fn check_bound(&self, u: &Unit) -> Result<()> {
        match &u.experts {
            Some(x) if x.source.is_none() => Err(Error::options(
                "bind_experts",
                format!(
                    "{}: the kept experts are not bound yet; call bind_experts({}, keep_ids) with {} ids before writing it",
                    u.label,
                    u.layer.unwrap_or_default(),
                    x.keep
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The pruning of this run, if any.
    pub fn pruning(&self) -> Option<&PruneSpec> {
        self.prune.as_ref()
    }

    /// Binds the experts MoE decoder layer `layer` keeps (source ids, ascending):
    /// its compact slot `c` is written from expert `keep_ids[c]`. Must come before
    /// the layer is written; binding again with another set is an error. Recorded
    /// in the resume manifest.
    pub fn bind_experts(&mut self, layer: usize, keep_ids: &[usize]) -> Result<()> {
        if bind_in_plan(&mut self.plan, self.prune.as_ref(), layer, keep_ids)? {
            self.save_manifest()?;
        }
        Ok(())
    }

    /// Per bound MoE layer, the length-E map: compact id of each source expert, or −1.
    pub fn expert_map(&self) -> std::collections::BTreeMap<usize, Vec<i64>> {
        self.plan
            .units
            .iter()
            .filter_map(|u| {
                let x = u.experts.as_ref()?;
                Some((
                    u.layer?,
                    crate::prune::expert_map(x.source.as_ref()?, x.num_experts),
                ))
            })
            .collect()
    }

    /// Quantizes unit `i`'s planned linears data-free (the RTN run's grid,
    /// format and device) and writes them.
    pub fn quantize_rtn(&self, i: usize) -> Result<()> {
        let u = self.unit(i)?;
        self.check_bound(u)?;
        if u.linears.is_empty() {
            return Ok(());
        }
        let spec = self.opts.quant()?.grid_spec();
        let grid = self.opts.grid_mode()?;
        match self.opts.cuda_device()? {
            Some(dev) => {
                let q = crate::CudaRtnQuantizer::new(grid, dev)?;
                crate::run::quantize_unit(self, i, &q, spec)
            }
            None => {
                let q = crate::RtnQuantizer { mode: grid };
                crate::run::quantize_unit(self, i, &q, spec)
            }
        }
    }

    fn linear(&self, module: &str) -> Result<&plan::LinearPlan> {
        self.linear_of
            .get(module)
            .and_then(|&(u, l)| self.plan.units.get(u)?.linears.get(l))
            .ok_or_else(|| {
                Error::options(
                    "module",
                    format!("{module:?} is not a linear this run quantizes"),
                )
            })
            .and_then(|l| {
                if l.weight.is_empty() {
                    Err(Error::options(
                        "bind_experts",
                        format!("{module}: its layer's kept experts are not bound yet; call bind_experts first"),
                    ))
                } else {
                    Ok(l)
                }
            })
    }

    fn write_packed(
        &self,
        l: &plan::LinearPlan,
        packed: forge_core::Result<Vec<crate::format::PackedTensor>>,
    ) -> Result<()> {
        let packed = packed.map_err(|e| Error::Quantize {
            file: self.ckpt.path().into(),
            tensor: l.weight.clone(),
            source: Box::new(e),
        })?;
        for (suffix, bytes) in packed {
            self.w()?
                .write_tensor(&format!("{}.{suffix}", l.module), &bytes)?;
        }
        Ok(())
    }

    /// Writes a quantized linear handed over in the AWQ layout (the fused
    /// RTN quantizers' output), converted exactly to the run's format.
    pub fn write_awq(&self, module: &str, t: &AwqTensors) -> Result<()> {
        let l = self.linear(module)?;
        let spec = self.opts.quant()?.grid_spec();
        self.write_packed(l, self.opts.format.from_awq(t, l.k, l.n, &spec))
    }

    /// Packs and writes a quantized linear from its codes `K × N` (row-major,
    /// one code per byte) and its grid `N × K/G` (qmeta4 words), in the run's format.
    pub fn write_linear(&self, module: &str, codes: &[u8], qmeta: &[QMeta]) -> Result<()> {
        let l = self.linear(module)?;
        let spec = self.opts.quant()?.grid_spec();
        self.write_packed(l, self.opts.format.pack(codes, qmeta, l.k, l.n, &spec))
    }

    /// Marks unit `i` finished: every planned output must have been written.
    /// Its shards are fsynced, `state` (a file the caller wrote at
    /// [`Session::state_path`]) is fsynced and recorded, the manifest is saved,
    /// the previous state file is removed, and the unit's source pages are
    /// released.
    pub fn commit(&mut self, i: usize, state: Option<&Path>) -> Result<()> {
        let u = self.unit(i)?.clone();
        let synced = self
            .synced
            .lock()
            .is_ok_and(|m| m.get(&i).is_some_and(|s| s.as_deref() == state));
        if !synced {
            self.unit_sync(i, state)?.run()?;
        }
        if let Ok(mut m) = self.synced.lock() {
            m.remove(&i);
        }
        // Without a new state, an earlier layer's stays the resume point.
        let previous = self.state.clone();
        if let Some(p) = state {
            let name = p
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            self.state = Some((u.key.clone(), name));
        }
        self.done.insert(u.key.clone());
        self.save_manifest()?;
        if let Some((_, old)) = previous {
            if self.state.as_ref().map(|s| &s.1) != Some(&old) {
                let _ = std::fs::remove_file(self.out_dir.join(STATE_DIR).join(old));
            }
        }
        self.ckpt
            .release(u.tensors.iter().map(|(name, _)| name.as_str()));
        Ok(())
    }

    /// The fsyncs that make unit `i` durable without recording it, as a job that owns what
    /// it needs: checks now that every planned output was written, and takes handles on the
    /// unit's shards and `state`. The job does not borrow the session, so the caller can run
    /// it on another thread while it works on (and binds, writes, commits) the next unit;
    /// [`Session::commit`] then only records the unit (the fsyncs are not repeated, and
    /// bytes the next unit wrote into a shared shard meanwhile are not waited for).
    pub fn unit_sync(&self, i: usize, state: Option<&Path>) -> Result<UnitSync> {
        let u = self.unit(i)?;
        let missing: Vec<&str> = u
            .outputs
            .iter()
            .filter(|o| !self.writer.as_ref().is_some_and(|w| w.is_written(o)))
            .map(String::as_str)
            .collect();
        if let Some(first) = missing.first() {
            return Err(Error::Quantizer {
                quantizer: self.opts.quantizer_name(),
                reason: format!(
                    "{}: {} output tensor(s) were never written, first {first:?}",
                    u.label,
                    missing.len()
                ),
            });
        }
        let names: BTreeSet<&str> = u
            .outputs
            .iter()
            .filter_map(|o| self.file_of.get(o.as_str()).map(String::as_str))
            .collect();
        let files = names
            .into_iter()
            .map(|f| self.w()?.sync_handle(f).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        Ok(UnitSync {
            index: i,
            files,
            state: state.map(Path::to_path_buf),
            synced: Arc::clone(&self.synced),
        })
    }

    /// Publishes the run: shards renamed into place, the index, side files,
    /// `extra` files of the caller (reports, router statistics), and
    /// `config.json` last. Every unit must be committed.
    ///
    /// Every stage is resumable: the manifest records that publication began
    /// and which shards are in place, so `--resume` after a crash anywhere in
    /// here accepts the renamed shards (header and size checked against the
    /// plan) and completes the rest. The manifest is removed last.
    pub fn finish(mut self, extra: &[(String, Vec<u8>)]) -> Result<RunReport> {
        if let Some(u) = self.plan.units.iter().find(|u| !self.done.contains(&u.key)) {
            return Err(Error::Quantizer {
                quantizer: self.opts.quantizer_name(),
                reason: format!("{} was never committed; the run is not finished", u.label),
            });
        }
        if self.writer.is_some() {
            self.publish_shards()?;
        }
        let pruning_block = self.pruning_block();
        let Session {
            ckpt: _,
            config,
            plan,
            opts,
            model_dir,
            out_dir,
            writer,
            mut notes,
            resumed,
            t0,
            prune,
            _lock: lock,
            ..
        } = self;
        let (n_shards, bytes_out) = writer.as_ref().map_or((0, 0), |w| {
            (w.plan().shards().len(), w.plan().total_bytes())
        });
        if let Some(w) = writer {
            w.write_index()?;
            copy_side_files(&model_dir, &out_dir, &mut notes)?;
        }
        for (name, bytes) in extra {
            // A plain name, or one inside the report folder `forge/`.
            let (dir, file) = match name.split_once('/') {
                Some((d, f)) if d == REPORT_DIR => (out_dir.join(d), f),
                Some(_) => ("".into(), ""),
                None => (out_dir.clone(), name.as_str()),
            };
            if file.is_empty() || file.contains(['/', '\\']) || file.starts_with('.') {
                return Err(Error::options(
                    "extra",
                    format!("{name:?} is not a file name (or {REPORT_DIR}/<name>)"),
                ));
            }
            std::fs::create_dir_all(&dir).map_err(Error::io("create directory", &dir))?;
            write_atomic(&dir.join(file), bytes)?;
        }
        let write_config = n_shards > 0;
        let mut cfg = if config.is_object() || !write_config {
            config.clone()
        } else {
            notes.push(
                "the model directory has no config.json; wrote one holding only quantization_config"
                    .into(),
            );
            json!({})
        };
        let quant = opts.quant()?;
        let has_lm_head = plan
            .units
            .iter()
            .filter(|u| u.layer.is_none())
            .any(|u| u.tensors.iter().any(|(n, _)| n == "lm_head.weight"));
        if let Some(obj) = cfg.as_object_mut() {
            obj.remove("quantization_config");
            obj.remove("compression_config");
            if opts.method != Method::None {
                obj.insert(
                    "quantization_config".into(),
                    opts.format
                        .quantization_config(&quant, &plan.not_convert, has_lm_head),
                );
            }
        }
        if let (Some(p), Some(block)) = (&prune, pruning_block) {
            if p.layout == Layout::Compact {
                let k = p.keep.values().next().copied().unwrap_or(p.num_experts);
                // Every spelling of the family's expert count that the config carries (a
                // Qwen-MoE config may hold both num_experts and num_local_experts), at the
                // top level and in text_config.
                for key in plan.arch.expert_count_keys {
                    if let Some(o) = cfg.as_object_mut() {
                        if o.contains_key(*key) {
                            o.insert((*key).into(), json!(k));
                        }
                        if let Some(t) = o.get_mut("text_config").and_then(Value::as_object_mut) {
                            if t.contains_key(*key) {
                                t.insert((*key).into(), json!(k));
                            }
                        }
                    }
                }
                // The MTP layers were dropped (see the plan's notes).
                if let Some(obj) = cfg
                    .as_object_mut()
                    .filter(|_| plan.units.iter().any(|u| u.mtp))
                {
                    if obj.contains_key("num_nextn_predict_layers") {
                        obj.insert("num_nextn_predict_layers".into(), json!(0));
                    }
                }
            }
            if let Some(obj) = cfg.as_object_mut() {
                obj.insert(crate::prune::CONFIG_KEY.into(), block);
                if p.layout == Layout::Remap {
                    if let Some(archs) = obj.get_mut("architectures").and_then(Value::as_array_mut)
                    {
                        for a in archs.iter_mut() {
                            if let Some(name) = a.as_str() {
                                *a = json!(format!("{}{name}", crate::prune::REMAP_ARCH_PREFIX));
                            }
                        }
                    }
                }
            }
        }
        if write_config {
            let text = serde_json::to_string_pretty(&cfg).unwrap_or_default() + "\n";
            write_atomic(&out_dir.join("config.json"), text.as_bytes())?;
        }
        let state_dir = out_dir.join(STATE_DIR);
        if state_dir.is_dir() {
            std::fs::remove_dir_all(&state_dir).map_err(Error::io("remove", &state_dir))?;
        }
        let manifest = out_dir.join(MANIFEST_FILE);
        std::fs::remove_file(&manifest).map_err(Error::io("remove", &manifest))?;
        drop(lock);
        let total_bytes: u64 = plan.units.iter().map(|u| u.bytes_in).sum();
        Ok(RunReport {
            out_dir,
            arch: plan.arch.name.into(),
            quantizer: opts.quantizer_name(),
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
}

impl Session {
    /// The `forge_expert_pruning` block of config.json (every pruned layer bound).
    fn pruning_block(&self) -> Option<Value> {
        let p = self.prune.as_ref()?;
        let map: serde_json::Map<String, Value> = self
            .expert_map()
            .into_iter()
            .map(|(l, m)| (l.to_string(), json!(m)))
            .collect();
        Some(json!({
            "layout": p.layout.name(),
            "criterion": p.criterion.name(),
            "num_original_experts": p.num_experts,
            "expert_map": map,
        }))
    }

    /// Renames every shard into place, recording each in the manifest.
    fn publish_shards(&mut self) -> Result<()> {
        let w = self.w()?;
        w.check_complete()?;
        if self.finishing.is_none() {
            self.finishing = Some(BTreeSet::new());
        }
        self.save_manifest()?;
        self.w()?.remove_stale_index()?;
        let abort_after = env_usize(ABORT_RENAMES_ENV);
        let n = self.w()?.plan().shards().len();
        let mut renamed = 0usize;
        for i in 0..n {
            let name = self.w()?.publish_shard(i)?.to_owned();
            let fresh = self.finishing.as_mut().is_some_and(|r| r.insert(name));
            if fresh {
                self.save_manifest()?;
                renamed += 1;
                if abort_after.is_some_and(|a| renamed >= a) && i + 1 < n {
                    return Err(Error::TestAbortFinish { renamed });
                }
            }
        }
        Ok(())
    }
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect()
}

/// Binds `layer`'s kept experts in the plan (the compact slots' source
/// weights). `Ok(true)` when the binding is new, `Ok(false)` when the same one
/// was already there.
fn bind_in_plan(
    plan: &mut RunPlan,
    prune: Option<&PruneSpec>,
    layer: usize,
    keep_ids: &[usize],
) -> Result<bool> {
    let Some(spec) = prune else {
        return Err(Error::options(
            "bind_experts",
            "this run prunes no experts (no keep_experts, prune_ratio or keep_mass)",
        ));
    };
    spec.check_keep_ids(layer, keep_ids)?;
    let Some(u) = plan
        .units
        .iter_mut()
        .find(|u| u.layer == Some(layer) && u.experts.is_some())
    else {
        return Err(Error::options(
            "layer",
            format!("layer {layer} is not a pruned MoE layer of this run"),
        ));
    };
    let Some(x) = u.experts.as_mut() else {
        return Ok(false);
    };
    if let Some(prev) = &x.source {
        if prev.as_slice() == keep_ids {
            return Ok(false);
        }
        return Err(Error::options(
            "bind_experts",
            format!("layer {layer} is already bound to experts {prev:?}; it cannot be bound again to {keep_ids:?}"),
        ));
    }
    x.source = Some(keep_ids.to_vec());
    for (c, id) in keep_ids.iter().enumerate() {
        for (leaf, a) in &x.leaves {
            if let Action::Quantize(j) = a {
                if let Some(l) = u.linears.get_mut(x.linear_base + c * x.n_quantized + j) {
                    l.weight = format!("{}{id}.{leaf}", x.prefix);
                }
            }
        }
    }
    Ok(true)
}

/// Bytes the shards still need on disk: their planned size less what their
/// files (`.partial` or in place) already occupy.
fn bytes_needed(out_dir: &Path, plan: &ShardPlan) -> u64 {
    use std::os::unix::fs::MetadataExt;
    plan.shards()
        .iter()
        .map(|s| {
            // The header is at most MAX_HEADER_BYTES; count it generously.
            let want = s.data_len + 8 + (s.tensors.len() as u64) * 160;
            let have = [
                out_dir.join(format!("{}{PARTIAL_SUFFIX}", s.file_name)),
                out_dir.join(&s.file_name),
            ]
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.blocks() * 512)
            .max()
            .unwrap_or(0);
            want.saturating_sub(have)
        })
        .sum()
}

/// Refuses to start when the output file system has less free space than
/// the shards still need (unless [`DISK_CHECK_ENV`] is `0`).
fn check_free_space(out_dir: &Path, plan: &ShardPlan) -> Result<()> {
    if std::env::var(DISK_CHECK_ENV).is_ok_and(|v| v.trim() == "0") {
        return Ok(());
    }
    let needed = bytes_needed(out_dir, plan);
    let available = free_bytes(out_dir)?;
    if needed > available {
        return Err(Error::OutDir {
            dir: out_dir.into(),
            reason: format!(
                "not enough free space: the output needs {needed} bytes ({:.2} GB) more, the file system has {available} bytes ({:.2} GB) available; free some space or choose another folder (set {DISK_CHECK_ENV}=0 to skip this check)",
                needed as f64 / 1e9,
                available as f64 / 1e9
            ),
        });
    }
    Ok(())
}

/// Bytes available to an unprivileged user on the file system of `dir`.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|_| Error::OutDir {
        dir: dir.into(),
        reason: "the path holds a NUL byte".into(),
    })?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid C string and `st` points to writable memory of the right type.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(Error::io("statvfs", dir)(std::io::Error::last_os_error()));
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u64 on Linux x86-64).
    #[allow(clippy::unnecessary_cast)]
    let (avail, frsize) = (st.f_bavail as u64, st.f_frsize as u64);
    Ok(avail.saturating_mul(frsize))
}

/// The fsyncs that make one finished unit durable (see [`Session::unit_sync`]): owned
/// handles on its shards and its state file, run on any thread.
pub struct UnitSync {
    index: usize,
    files: Vec<(File, PathBuf)>,
    state: Option<PathBuf>,
    synced: Arc<std::sync::Mutex<HashMap<usize, Option<PathBuf>>>>,
}

impl UnitSync {
    /// Fsyncs the shards and the state, then notes the unit as synced for its commit.
    pub fn run(self) -> Result<()> {
        for (file, path) in &self.files {
            file.sync_data().map_err(Error::io("fsync", path))?;
        }
        if let Some(p) = &self.state {
            File::open(p)
                .and_then(|h| h.sync_all())
                .map_err(Error::io("fsync", p))?;
        }
        if let Ok(mut m) = self.synced.lock() {
            m.insert(self.index, self.state);
        }
        Ok(())
    }
}
