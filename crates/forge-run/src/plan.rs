//! The run plan: what happens to every source tensor, the exact output tensor
//! set, and `modules_to_not_convert`, all decided (and validated) before any
//! byte is written.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use forge_core::grid::{GridMode, GridSpec};
use forge_core::pack::check_pack_shape;
use forge_io::{Checkpoint, Dtype, TensorSpec};
use serde_json::{json, Value};

use crate::arch::{num_hidden_layers, Architecture, Pattern};
use crate::format::OutputFormat;
use crate::prune::{Layout, PruneSpec};
use crate::{Error, Result};

/// What to quantize and how (everything that changes the output bytes).
#[derive(Debug, Clone)]
pub struct QuantOptions {
    /// Output checkpoint format (the tensors and config block of a quantized linear).
    pub format: OutputFormat,
    /// Group size along the input dimension (32, 64, 128 for vLLM's Marlin path).
    pub group_size: usize,
    /// Symmetric grid (zero point 8) instead of asymmetric.
    pub symmetric: bool,
    /// Range grid, or range refined by the MSE / L^p search.
    pub grid: GridMode,
    /// When non-empty, only linears matching one of these are quantized.
    pub include: Vec<Pattern>,
    /// Linears matching one of these stay unquantized.
    pub exclude: Vec<Pattern>,
    /// Apply the family's default exclusions (DeepSeek: `kv_b_proj`).
    pub default_excludes: bool,
    /// Leave linears whose shape cannot be packed unquantized (and list them)
    /// instead of failing.
    pub skip_unpackable: bool,
    /// Maximum tensor bytes per output shard.
    pub max_shard_bytes: u64,
    /// Quantize the selected linears (false: method `none`, every tensor copied).
    pub quantize: bool,
    /// Write no tensor at all (a run that only collects router statistics).
    pub stats_only: bool,
}

impl Default for QuantOptions {
    fn default() -> Self {
        QuantOptions {
            format: OutputFormat::Awq,
            group_size: 128,
            symmetric: false,
            grid: GridMode::Range,
            include: Vec::new(),
            exclude: Vec::new(),
            default_excludes: true,
            skip_unpackable: false,
            max_shard_bytes: forge_io::DEFAULT_MAX_SHARD_BYTES,
            quantize: true,
            stats_only: false,
        }
    }
}

impl QuantOptions {
    /// The grid specification (4 bits).
    pub fn grid_spec(&self) -> GridSpec {
        GridSpec {
            bits: 4,
            group_size: self.group_size,
            symmetric: self.symmetric,
        }
    }

    /// A canonical JSON form, stored in the manifest and compared on resume.
    pub fn to_json(&self) -> Value {
        let grid = match self.grid {
            GridMode::Range => json!("range"),
            GridMode::Mse(m) => json!({
                "mse": {"max_shrink": m.max_shrink, "n_grid": m.n_grid, "norm": m.norm}
            }),
        };
        json!({
            "format": self.format.name(),
            "bits": 4,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "grid": grid,
            "include": self.include.iter().map(Pattern::as_str).collect::<Vec<_>>(),
            "exclude": self.exclude.iter().map(Pattern::as_str).collect::<Vec<_>>(),
            "default_excludes": self.default_excludes,
            "skip_unpackable": self.skip_unpackable,
            "max_shard_bytes": self.max_shard_bytes,
            "quantize": self.quantize,
            "stats_only": self.stats_only,
        })
    }
}

/// What happens to one source tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Quantized: index into [`Unit::linears`]; written as the tensors of the
    /// output format ([`OutputFormat::specs`]).
    Quantize(usize),
    /// Copied byte for byte.
    Copy,
    /// An FP8 tensor kept unquantized: dequantized with its `weight_scale_inv`, written as bf16.
    ToBf16,
    /// Not written (the `weight_scale_inv` of an FP8 weight).
    Drop,
    /// A routed expert's tensor in a pruned layer: written (under its compact
    /// slot, see [`ExpertSet`]) only when its expert is kept.
    Expert,
    /// A router row tensor in a compact pruned layer (`gate.weight`,
    /// `e_score_correction_bias`): written as the rows of the kept experts
    /// (FP8 → bf16).
    SliceRows,
}

/// The routed experts of a pruned MoE layer: written as compact slots
/// `<prefix><c>.<leaf>` for `c` in `0..keep`, slot `c` holding source expert
/// `source[c]` once bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSet {
    /// `model.layers.3.mlp.experts.`
    pub prefix: String,
    /// Routed experts of the source layer.
    pub num_experts: usize,
    /// Experts kept.
    pub keep: usize,
    /// Kept source ids (ascending), once bound.
    pub source: Option<Vec<usize>>,
    /// The tensors of one expert (`gate_proj.weight`, ...) and their fate:
    /// `Quantize(j)` (linear `linear_base + c · n_quantized + j` of slot `c`),
    /// `Copy`, `ToBf16` or `Drop`.
    pub leaves: Vec<(String, Action)>,
    /// Index in [`Unit::linears`] of slot 0's first quantized leaf.
    pub linear_base: usize,
    /// Quantized leaves per expert.
    pub n_quantized: usize,
}

impl ExpertSet {
    /// Source tensor name of `leaf` for compact slot `c` (`None` while unbound).
    pub fn source_of(&self, c: usize, leaf: &str) -> Option<String> {
        let id = self.source.as_ref()?.get(c)?;
        Some(format!("{}{id}.{leaf}", self.prefix))
    }
}

/// A linear to quantize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearPlan {
    /// Module name (`model.layers.3.mlp.experts.7.up_proj`).
    pub module: String,
    /// Source weight tensor (`<module>.weight`).
    pub weight: String,
    /// out_features.
    pub n: usize,
    /// in_features.
    pub k: usize,
}

/// A piece of work finished (and recorded in the manifest) as a whole: one
/// decoder layer, or the tensors outside the layers.
#[derive(Debug, Clone)]
pub struct Unit {
    /// `layer 3`, `mtp layer 61`, `non-layer tensors`.
    pub label: String,
    /// Manifest key: `layer.3` or `other`.
    pub key: String,
    /// Decoder layer index, if any.
    pub layer: Option<usize>,
    /// Whether it is an MTP layer (copied unquantized).
    pub mtp: bool,
    /// Source tensors (sorted by name) and their fate.
    pub tensors: Vec<(String, Action)>,
    /// The linears quantized in this unit.
    pub linears: Vec<LinearPlan>,
    /// Output tensor names of this unit.
    pub outputs: Vec<String>,
    /// Source bytes read by this unit.
    pub bytes_in: u64,
    /// The routed experts, when this layer is pruned.
    pub experts: Option<ExpertSet>,
}

/// The whole run, decided up front.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The detected family.
    pub arch: Architecture,
    /// Work units in processing order.
    pub units: Vec<Unit>,
    /// Every output tensor, in plan order.
    pub specs: Vec<TensorSpec>,
    /// `quantization_config.modules_to_not_convert`.
    pub not_convert: Vec<String>,
    /// Decisions worth telling the user (fused groups pulled out, ...).
    pub notes: Vec<String>,
    /// Whether the source holds FP8 weights.
    pub fp8_source: bool,
}

impl RunPlan {
    /// Quantized module names.
    pub fn quantized(&self) -> impl Iterator<Item = &str> {
        self.units
            .iter()
            .flat_map(|u| u.linears.iter().map(|l| l.module.as_str()))
    }

    /// Number of quantized linears.
    pub fn n_quantized(&self) -> usize {
        self.units.iter().map(|u| u.linears.len()).sum()
    }
}

fn module_of(name: &str) -> &str {
    name.strip_suffix(".weight").unwrap_or(name)
}

/// Reads `config.json` from a model directory (`Value::Null` if absent).
pub fn read_config(dir: &Path) -> Result<Value> {
    let path = dir.join("config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let v: Value =
                serde_json::from_str(&text).map_err(|e| Error::config(&path, e.to_string()))?;
            if !v.is_object() {
                return Err(Error::config(&path, "not a JSON object"));
            }
            Ok(v)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Value::Null),
        Err(e) => Err(Error::io("read", &path)(e)),
    }
}

/// The decoder layers (MTP layers excluded) that hold routed experts.
pub fn moe_layers(ckpt: &Checkpoint, config: &Value) -> Vec<usize> {
    let arch = Architecture::detect(config);
    let n_layers = num_hidden_layers(config);
    ckpt.layers()
        .into_iter()
        .filter(|&l| !(arch.has_mtp && n_layers.is_some_and(|n| l >= n)))
        .filter(|&l| {
            ckpt.layer_tensors(l)
                .iter()
                .any(|n| arch.expert_of(n).is_some())
        })
        .collect()
}

/// The output tensors of unit `u`, in plan order.
pub fn unit_specs(ckpt: &Checkpoint, u: &Unit, opts: &QuantOptions) -> Result<Vec<TensorSpec>> {
    let (g, sym) = (opts.group_size, opts.symmetric);
    let mut specs = Vec::new();
    let keep = u.experts.as_ref().map_or(0, |x| x.keep);
    for (name, action) in &u.tensors {
        match action {
            Action::Quantize(i) => {
                let l = &u.linears[*i];
                specs.extend(opts.format.specs(&l.module, l.n, l.k, g, sym));
            }
            Action::Copy => {
                let t = ckpt.tensor(name)?;
                specs.push(TensorSpec::new(name.clone(), t.dtype, t.shape.to_vec()));
            }
            Action::ToBf16 => {
                let t = ckpt.tensor(name)?;
                specs.push(TensorSpec::new(name.clone(), Dtype::BF16, t.shape.to_vec()));
            }
            Action::SliceRows => {
                let t = ckpt.tensor(name)?;
                let mut shape = t.shape.to_vec();
                shape[0] = keep;
                let dtype = if t.dtype == Dtype::F8_E4M3 {
                    Dtype::BF16
                } else {
                    t.dtype
                };
                specs.push(TensorSpec::new(name.clone(), dtype, shape));
            }
            Action::Drop | Action::Expert => {}
        }
    }
    if let Some(x) = &u.experts {
        for c in 0..x.keep {
            for (leaf, action) in &x.leaves {
                let src = format!("{}0.{leaf}", x.prefix);
                let out = format!("{}{c}.{leaf}", x.prefix);
                match action {
                    Action::Quantize(j) => {
                        let l = &u.linears[x.linear_base + c * x.n_quantized + j];
                        specs.extend(opts.format.specs(&l.module, l.n, l.k, g, sym));
                    }
                    Action::Copy => {
                        let t = ckpt.tensor(&src)?;
                        specs.push(TensorSpec::new(out, t.dtype, t.shape.to_vec()));
                    }
                    Action::ToBf16 => {
                        let t = ckpt.tensor(&src)?;
                        specs.push(TensorSpec::new(out, Dtype::BF16, t.shape.to_vec()));
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(specs)
}

/// Builds and validates the plan.
pub fn build(ckpt: &Checkpoint, config: &Value, opts: &QuantOptions) -> Result<RunPlan> {
    build_with(ckpt, config, opts, None)
}

/// Builds and validates the plan of a run that may prune routed experts.
pub fn build_with(
    ckpt: &Checkpoint,
    config: &Value,
    opts: &QuantOptions,
    prune: Option<&PruneSpec>,
) -> Result<RunPlan> {
    let spec = opts.grid_spec();
    spec.validate()
        .map_err(|e| Error::options("group_size", e.to_string()))?;
    if opts.max_shard_bytes == 0 {
        return Err(Error::options("max_shard_size", "must be positive"));
    }
    let cfg_path = ckpt.path().join("config.json");
    if let Some(q) = config.get("quantization_config") {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        if method != "fp8" {
            return Err(Error::config(
                &cfg_path,
                format!("the source is already quantized (quantization_config.quant_method = {method:?}); start from a bf16 or FP8 checkpoint"),
            ));
        }
    }
    if let Some(t) = ckpt
        .names()
        .find(|n| n.ends_with(".qweight") || n.ends_with(".weight_packed"))
    {
        return Err(Error::config(
            ckpt.path(),
            format!("the source is already quantized (it holds {t:?}); start from a bf16 or FP8 checkpoint"),
        ));
    }
    // FP8 weights need a well-formed block scale: checked here, before any byte is written.
    for t in ckpt.iter().filter(|t| t.dtype == Dtype::F8_E4M3) {
        ckpt.fp8_scale(t.name)?;
    }
    let arch = Architecture::detect(config);
    let n_layers = num_hidden_layers(config);
    let mut notes = Vec::new();
    let fp8_source = ckpt.iter().any(|t| t.dtype == Dtype::F8_E4M3);

    // FP8 weights and their scales.
    let is_fp8_weight = |name: &str| ckpt.get(name).is_some_and(|t| t.dtype == Dtype::F8_E4M3);
    let scale_of =
        |name: &str| -> bool { name.strip_suffix("_scale_inv").is_some_and(is_fp8_weight) };
    let fate_unquantized = |name: &str| -> Result<Action> {
        if scale_of(name) {
            return Ok(Action::Drop);
        }
        if is_fp8_weight(name) {
            if ckpt.get(&format!("{name}_scale_inv")).is_none() {
                let t = ckpt.tensor(name)?;
                return Err(Error::config(
                    t.file,
                    format!("FP8 tensor {name:?} has no {name}_scale_inv; only DeepSeek-style block-scaled FP8 is supported"),
                ));
            }
            return Ok(Action::ToBf16);
        }
        Ok(Action::Copy)
    };

    let mut units = Vec::new();
    let mut not_convert = Vec::new();
    let mut unpackable: Vec<(String, String)> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut pulled: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut dropped_mtp: Vec<usize> = Vec::new();
    for layer in ckpt.layers() {
        let names = {
            let mut v: Vec<&str> = ckpt.layer_tensors(layer);
            v.sort_unstable();
            v
        };
        let mtp = arch.has_mtp && n_layers.is_some_and(|n| layer >= n);
        let label = if mtp {
            format!("mtp layer {layer}")
        } else {
            format!("layer {layer}")
        };
        let compact = prune.is_some_and(|p| p.layout == Layout::Compact);
        if opts.stats_only || (mtp && compact) {
            // Nothing of it is written: a statistics run, or an MTP layer whose
            // experts cannot be scored (the compact config count would not fit it).
            let mut bytes_in = 0u64;
            let mut tensors = Vec::new();
            for &name in &names {
                bytes_in += ckpt.tensor(name)?.bytes.len() as u64;
                tensors.push((name.to_string(), Action::Drop));
            }
            if !opts.stats_only {
                dropped_mtp.push(layer);
            }
            units.push(Unit {
                label,
                key: format!("layer.{layer}"),
                layer: Some(layer),
                mtp,
                tensors,
                linears: Vec::new(),
                outputs: Vec::new(),
                bytes_in,
                experts: None,
            });
            continue;
        }
        // 1. Candidate linears and the user's wish.
        let mut want: BTreeMap<&str, bool> = BTreeMap::new();
        let mut routers: Vec<&str> = Vec::new();
        for &name in &names {
            let t = ckpt.tensor(name)?;
            let module = module_of(name);
            if name.ends_with(".weight") && arch.is_router(module) {
                routers.push(module);
            } else if arch.is_linear(name, t.shape) {
                let selected = !mtp
                    && opts.quantize
                    && (opts.include.is_empty() || opts.include.iter().any(|p| p.matches(module)))
                    && !opts.exclude.iter().any(|p| p.matches(module))
                    && !(opts.default_excludes
                        && arch
                            .default_exclude
                            .iter()
                            .any(|p| Pattern::new(p).is_some_and(|p| p.matches(module))));
                want.insert(module, selected);
            }
        }
        // 2. Dtypes and shapes that cannot be quantized.
        for (module, sel) in want.iter_mut() {
            if !*sel {
                continue;
            }
            let t = ckpt.tensor(&format!("{module}.weight"))?;
            if !t.dtype.is_float() {
                let leaf = module.rsplit('.').next().unwrap_or(module);
                return Err(Error::config(
                    t.file,
                    format!(
                        "tensor {:?} has dtype {}: only floating-point linears can be quantized; leave it unquantized with --exclude {leaf}",
                        t.name,
                        t.dtype.name()
                    ),
                ));
            }
            let (n, k) = (t.shape[0], t.shape[1]);
            if let Err(e) = check_pack_shape(k, n, &spec) {
                let leaf = module.rsplit('.').next().unwrap_or(module);
                let reason = format!(
                    "weight [{n}, {k}] (out_features {n}, in_features {k}) cannot be packed with group size {}: {e}; leave it unquantized with --exclude {leaf} (or --skip-unpackable), or pick another --group-size",
                    spec.group_size
                );
                if opts.skip_unpackable {
                    skipped.push(format!("{module} [{n}, {k}]"));
                    *sel = false;
                } else {
                    unpackable.push((module.to_string(), reason));
                }
            }
        }
        // 3. Fused groups and MoE expert sets are all-or-none.
        let mut groups: BTreeMap<(String, &str), Vec<&str>> = BTreeMap::new();
        for &module in want.keys() {
            if let Some((parent, g)) = arch.fused_group_of(module) {
                // Experts: the group is per expert (its parent includes the id).
                groups
                    .entry((parent.to_string(), g.fused_name))
                    .or_default()
                    .push(module);
            }
            if let Some((experts, _)) = arch.expert_of(module) {
                groups
                    .entry((experts.to_string(), ""))
                    .or_default()
                    .push(module);
            }
        }
        // Expert sets can be pulled out by fused groups and vice versa: iterate to a fixpoint.
        loop {
            let mut changed = false;
            for ((parent, fused), members) in &groups {
                let on = members.iter().filter(|m| want[*m]).count();
                if on > 0 && on < members.len() {
                    let off = members
                        .iter()
                        .find(|m| !want[*m])
                        .copied()
                        .unwrap_or_default();
                    let leaf = |m: &str| m.rsplit('.').next().unwrap_or(m).to_string();
                    let key = if fused.is_empty() {
                        "routed experts must all share one quantization (vLLM runs them as one fused MoE)".to_string()
                    } else {
                        let leaves: Vec<String> = members.iter().map(|m| leaf(m)).collect();
                        format!(
                            "vLLM fuses {} into {fused}, and {} is unquantized",
                            leaves.join("+"),
                            leaf(off)
                        )
                    };
                    let e = pulled.entry(key).or_insert((0, String::new()));
                    e.0 += on;
                    if e.1.is_empty() {
                        e.1 = format!("{parent}, because {off} is unquantized");
                    }
                    for m in members {
                        if let Some(w) = want.get_mut(*m) {
                            *w = false;
                        }
                    }
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }

        // 4. Tensor fates and outputs.
        let mut linears = Vec::new();
        let mut tensors = Vec::new();
        let mut bytes_in = 0u64;
        let pruned = prune
            .filter(|_| !mtp)
            .and_then(|p| p.keep.get(&layer).map(|&k| (p, k)));
        let experts_module = match pruned {
            Some((p, _)) => Some(expert_layout(ckpt, &arch, layer, &names, p.num_experts)?),
            None => None,
        };
        for &name in &names {
            let t = ckpt.tensor(name)?;
            bytes_in += t.bytes.len() as u64;
            let module = module_of(name);
            if let (Some((p, _)), Some((em, _))) = (pruned, &experts_module) {
                if arch.expert_of(name).is_some_and(|(m, _)| m == em) {
                    tensors.push((name.to_string(), Action::Expert));
                    continue;
                }
                let router = format!("{}.gate.", em.rsplit_once('.').map_or("", |x| x.0));
                if p.layout == Layout::Compact
                    && name.starts_with(&router)
                    && !scale_of(name)
                    && t.shape.first() == Some(&p.num_experts)
                {
                    tensors.push((name.to_string(), Action::SliceRows));
                    continue;
                }
            }
            let quantize = name.ends_with(".weight") && want.get(module) == Some(&true);
            let action = if quantize {
                let (n, k) = (t.shape[0], t.shape[1]);
                linears.push(LinearPlan {
                    module: module.to_string(),
                    weight: name.to_string(),
                    n,
                    k,
                });
                Action::Quantize(linears.len() - 1)
            } else {
                fate_unquantized(name)?
            };
            // A quantized FP8 weight's scale is dropped too.
            let action = match action {
                Action::Copy if scale_of(name) => Action::Drop,
                a => a,
            };
            tensors.push((name.to_string(), action));
        }
        // The kept experts, as compact slots.
        let mut experts = None;
        if let (Some((p, keep)), Some((em, leaves))) = (pruned, &experts_module) {
            let prefix = format!("{em}.");
            let linear_base = linears.len();
            let mut fates = Vec::new();
            let mut quantized = Vec::new();
            for leaf in leaves {
                let src = format!("{prefix}0.{leaf}");
                let module = module_of(&src);
                let action = if src.ends_with(".weight") && want.get(module) == Some(&true) {
                    let t = ckpt.tensor(&src)?;
                    quantized.push((
                        leaf.strip_suffix(".weight").unwrap_or(leaf),
                        t.shape[0],
                        t.shape[1],
                    ));
                    Action::Quantize(quantized.len() - 1)
                } else {
                    fate_unquantized(&src)?
                };
                fates.push((leaf.clone(), action));
            }
            let source = p.bound.get(&layer).cloned();
            for c in 0..keep {
                for (leaf, n, k) in &quantized {
                    linears.push(LinearPlan {
                        module: format!("{prefix}{c}.{leaf}"),
                        weight: source
                            .as_ref()
                            .map(|s| format!("{prefix}{}.{leaf}.weight", s[c]))
                            .unwrap_or_default(),
                        n: *n,
                        k: *k,
                    });
                }
            }
            experts = Some(ExpertSet {
                prefix,
                num_experts: p.num_experts,
                keep,
                source,
                leaves: fates,
                linear_base,
                n_quantized: quantized.len(),
            });
        }
        // 5. modules_to_not_convert of this layer.
        let mut skip: BTreeSet<String> = BTreeSet::new();
        for (m, q) in &want {
            if !q {
                skip.insert((*m).to_string());
            }
        }
        for r in &routers {
            skip.insert((*r).to_string());
        }
        if let Some(x) = &experts {
            // Unquantized experts by their compact names (the source ids do not exist in the output).
            let em = x.prefix.trim_end_matches('.');
            skip.retain(|m| arch.expert_of(m).is_none_or(|(p, _)| p != em));
            for (leaf, a) in &x.leaves {
                if let (Some(m), Action::Copy | Action::ToBf16) = (leaf.strip_suffix(".weight"), a)
                {
                    if want.contains_key(format!("{}0.{m}", x.prefix).as_str()) {
                        for c in 0..x.keep {
                            skip.insert(format!("{}{c}.{m}", x.prefix));
                        }
                    }
                }
            }
        }
        for ((parent, fused), members) in &groups {
            if members.iter().all(|m| !want[*m]) {
                if fused.is_empty() {
                    skip.insert(parent.clone());
                } else if members.len() > 1 && arch.expert_of(&format!("{parent}.x")).is_none() {
                    skip.insert(format!("{parent}.{fused}"));
                }
            }
        }
        // vLLM matches these (AWQ: as substrings): none may hit a quantized module.
        for l in &linears {
            if let Some(s) = skip.iter().find(|s| opts.format.skips(s, &l.module)) {
                return Err(Error::Unpackable {
                    module: l.module.clone(),
                    reason: format!(
                        "vLLM would skip it because the {} entry {s:?} (format {}) matches its name; exclude it too",
                        opts.format.skip_list_name(),
                        opts.format.name()
                    ),
                });
            }
        }
        not_convert.extend(skip);
        let mut unit = Unit {
            label,
            key: format!("layer.{layer}"),
            layer: Some(layer),
            mtp,
            tensors,
            linears,
            outputs: Vec::new(),
            bytes_in,
            experts,
        };
        unit.outputs = unit_specs(ckpt, &unit, opts)?
            .into_iter()
            .map(|s| s.name)
            .collect();
        units.push(unit);
    }
    if let Some((module, reason)) = unpackable.first() {
        let more = if unpackable.len() > 1 {
            format!(
                " ({} more linears have the same problem)",
                unpackable.len() - 1
            )
        } else {
            String::new()
        };
        return Err(Error::Unpackable {
            module: module.clone(),
            reason: format!("{reason}{more}"),
        });
    }

    if !skipped.is_empty() {
        notes.push(format!(
            "{} linear(s) left unquantized because their shape cannot be packed with group size {} (--skip-unpackable), e.g. {}",
            skipped.len(),
            spec.group_size,
            skipped.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    for (why, (count, example)) in &pulled {
        notes.push(format!(
            "{count} linear(s) left unquantized: {why} (first in {example})"
        ));
    }

    // Tensors outside the decoder layers: copied (FP8 → bf16).
    let mut rest: Vec<&str> = ckpt.non_layer_tensors();
    rest.sort_unstable();
    if !rest.is_empty() {
        let mut tensors = Vec::new();
        let mut outputs = Vec::new();
        let mut bytes_in = 0u64;
        for name in rest {
            bytes_in += ckpt.tensor(name)?.bytes.len() as u64;
            let action = if opts.stats_only {
                Action::Drop
            } else {
                fate_unquantized(name)?
            };
            if action != Action::Drop {
                outputs.push(name.to_string());
            }
            tensors.push((name.to_string(), action));
        }
        // First: the calibrated run needs the embeddings before any layer.
        units.insert(
            0,
            Unit {
                label: "non-layer tensors".into(),
                key: "other".into(),
                layer: None,
                mtp: false,
                tensors,
                linears: Vec::new(),
                outputs,
                bytes_in,
                experts: None,
            },
        );
    }
    if !dropped_mtp.is_empty() {
        notes.push(format!(
            "{} MTP layer(s) dropped ({:?}): their experts cannot be scored, and the compact expert count would not fit them",
            dropped_mtp.len(),
            dropped_mtp
        ));
    }

    // Output specs.
    let mut specs = Vec::new();
    for u in &units {
        specs.extend(unit_specs(ckpt, u, opts)?);
    }
    let mut seen: HashMap<&str, ()> = HashMap::new();
    for s in &specs {
        if seen.insert(&s.name, ()).is_some() {
            return Err(Error::config(
                ckpt.path(),
                format!("output tensor {:?} would be produced twice (the source holds both a weight and its quantized form)", s.name),
            ));
        }
    }
    if specs.is_empty() && !opts.stats_only {
        return Err(Error::config(
            ckpt.path(),
            "the checkpoint holds no tensors",
        ));
    }
    if units.iter().all(|u| u.linears.is_empty()) && opts.quantize && !opts.stats_only {
        notes.push(
            "no linear was selected for quantization; the output is an unquantized copy".into(),
        );
    }
    Ok(RunPlan {
        arch,
        units,
        specs,
        not_convert,
        notes,
        fp8_source,
    })
}

/// The routed experts of a pruned layer: their module (`model.layers.3.mlp.experts`)
/// and the tensor leaves of one expert (`gate_proj.weight`, ...), checked to be
/// experts `0..e`, each with the same tensors, dtypes and shapes (a compact
/// slot's shape is planned before the experts are chosen).
fn expert_layout(
    ckpt: &Checkpoint,
    arch: &Architecture,
    layer: usize,
    names: &[&str],
    e: usize,
) -> Result<(String, Vec<String>)> {
    let mut by_id: BTreeMap<usize, BTreeMap<String, &str>> = BTreeMap::new();
    let mut module: Option<&str> = None;
    for &name in names {
        let Some((m, id)) = arch.expert_of(name) else {
            continue;
        };
        if module.is_some_and(|x| x != m) {
            return Err(Error::config(
                ckpt.path(),
                format!(
                    "layer {layer} holds two sets of routed experts ({} and {m}); cannot prune it",
                    module.unwrap_or_default()
                ),
            ));
        }
        module = Some(m);
        let leaf = &name[m.len() + 1..];
        let leaf = leaf.split_once('.').map_or(leaf, |x| x.1);
        by_id.entry(id).or_default().insert(leaf.to_owned(), name);
    }
    let Some(m) = module else {
        return Err(Error::config(
            ckpt.path(),
            format!("layer {layer} has no routed expert tensors to prune"),
        ));
    };
    let ids: Vec<usize> = by_id.keys().copied().collect();
    if ids != (0..e).collect::<Vec<_>>() {
        return Err(Error::config(
            ckpt.path(),
            format!(
                "{m}: expert ids are not exactly 0..{e} (config expert count {e}); cannot prune"
            ),
        ));
    }
    let first = &by_id[&0];
    for (id, leaves) in &by_id {
        if leaves.keys().ne(first.keys()) {
            return Err(Error::config(
                ckpt.path(),
                format!(
                    "{m}.{id}: tensors {:?} differ from expert 0's {:?}",
                    leaves.keys().collect::<Vec<_>>(),
                    first.keys().collect::<Vec<_>>()
                ),
            ));
        }
        for (leaf, name) in leaves {
            let (a, b) = (ckpt.tensor(first[leaf])?, ckpt.tensor(name)?);
            if a.dtype != b.dtype || a.shape != b.shape {
                return Err(Error::config(
                    b.file,
                    format!("{name}: {} {:?} differs from expert 0's {} {:?}; experts must agree to be renumbered", b.dtype, b.shape, a.dtype, a.shape),
                ));
            }
        }
    }
    Ok((m.to_owned(), first.keys().cloned().collect()))
}
