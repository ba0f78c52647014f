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

/// Builds and validates the plan.
pub fn build(ckpt: &Checkpoint, config: &Value, opts: &QuantOptions) -> Result<RunPlan> {
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
    for layer in ckpt.layers() {
        let names = {
            let mut v: Vec<&str> = ckpt.layer_tensors(layer);
            v.sort_unstable();
            v
        };
        let mtp = arch.has_mtp && n_layers.is_some_and(|n| layer >= n);
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
        let mut outputs = Vec::new();
        let mut bytes_in = 0u64;
        for &name in &names {
            let t = ckpt.tensor(name)?;
            bytes_in += t.bytes.len() as u64;
            let module = module_of(name);
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
        for (name, action) in &tensors {
            match action {
                Action::Quantize(i) => {
                    let l = &linears[*i];
                    outputs.extend(
                        opts.format
                            .specs(&l.module, l.n, l.k, spec.group_size, spec.symmetric)
                            .into_iter()
                            .map(|s| s.name),
                    );
                }
                Action::Copy | Action::ToBf16 => outputs.push(name.clone()),
                Action::Drop => {}
            }
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
        let label = if mtp {
            format!("mtp layer {layer}")
        } else {
            format!("layer {layer}")
        };
        units.push(Unit {
            label,
            key: format!("layer.{layer}"),
            layer: Some(layer),
            mtp,
            tensors,
            linears,
            outputs,
            bytes_in,
        });
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
            let action = fate_unquantized(name)?;
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
            },
        );
    }

    // Output specs.
    let g = spec.group_size;
    let mut specs = Vec::new();
    for u in &units {
        for (name, action) in &u.tensors {
            match action {
                Action::Quantize(i) => {
                    let l = &u.linears[*i];
                    specs.extend(opts.format.specs(&l.module, l.n, l.k, g, spec.symmetric));
                }
                Action::Copy => {
                    let t = ckpt.tensor(name)?;
                    specs.push(TensorSpec::new(name.clone(), t.dtype, t.shape.to_vec()));
                }
                Action::ToBf16 => {
                    let t = ckpt.tensor(name)?;
                    specs.push(TensorSpec::new(name.clone(), Dtype::BF16, t.shape.to_vec()));
                }
                Action::Drop => {}
            }
        }
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
    if specs.is_empty() {
        return Err(Error::config(
            ckpt.path(),
            "the checkpoint holds no tensors",
        ));
    }
    if units.iter().all(|u| u.linears.is_empty()) {
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
