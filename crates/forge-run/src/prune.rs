//! Expert pruning, decided in one place: which routed experts a MoE layer
//! keeps ([`select_experts`]), how many ([`resolve`], from the options and the
//! model's routing config), the router statistics of an earlier run
//! ([`RouterStats`]), and the per-layer expert map written to `config.json`.
//!
//! Two output layouts (facts: shared/notes/formats.md, "Expert pruning and vLLM"):
//!
//! - **compact** (default): the kept experts are renumbered densely `0..k`
//!   in their original order, the router rows and `e_score_correction_bias`
//!   are sliced the same way, and the config's expert count is set to `k`.
//!   Stock vLLM loads it. Every MoE layer keeps the same `k`; with
//!   group-limited routing (`n_group > 1`) every original group keeps
//!   `k / n_group` experts, so the group semantics survive.
//! - **remap**: router and bias untouched (all `E` rows), the config's count
//!   stays `E`, the experts of each layer are compact (per-layer `k` allowed);
//!   a runtime patch routes over the original experts and drops the pruned ones
//!   with the `expert_map` of `config.json`'s `forge_expert_pruning` block.
//!
//! Keep count from `prune_ratio` (fraction pruned): without groups (or in the
//! remap layout) `k = max(1, round(E · (1 − ratio)))`; with `n_group > 1` in
//! the compact layout, each group keeps `max(1, round(E / n_group · (1 − ratio)))`
//! and `k` is that times `n_group`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use forge_io::{Checkpoint, Dtype};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::arch::{config_dim, Architecture};
use crate::options::Options;
use crate::{Error, Result};

/// `format` of the `forge` metadata of `router_stats.safetensors`.
pub const STATS_FORMAT: &str = "4bit-forge router stats v1";
/// Where a run writes its router statistics (inside the output folder).
pub const STATS_FILE: &str = "forge/router_stats.safetensors";
/// Key of the pruning block in the output `config.json`.
pub const CONFIG_KEY: &str = "forge_expert_pruning";
/// Prefix of a remap checkpoint's `architectures`: stock vLLM refuses the unknown name (instead
/// of loading experts it cannot route and leaving slots uninitialised), and forge's vLLM plugin
/// (`forge.vllm_plugin.REMAP_ARCH_PREFIX`) registers each prefixed name as the family's class.
pub const REMAP_ARCH_PREFIX: &str = "ForgeRemap";

/// How experts are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Criterion {
    /// Mean over routed tokens of router weight × ‖expert output‖ (`reap / max(counts, 1)`).
    Reap,
    /// Routed-token count.
    Frequency,
    /// Summed router probability mass.
    Mass,
    /// A seeded permutation (deterministic from seed and layer): a baseline.
    Random,
}

impl Criterion {
    /// The option value.
    pub fn name(self) -> &'static str {
        match self {
            Criterion::Reap => "reap",
            Criterion::Frequency => "frequency",
            Criterion::Mass => "mass",
            Criterion::Random => "random",
        }
    }

    /// Parses an option value.
    pub fn parse(s: &str) -> Option<Criterion> {
        [
            Criterion::Reap,
            Criterion::Frequency,
            Criterion::Mass,
            Criterion::Random,
        ]
        .into_iter()
        .find(|c| c.name() == s)
    }
}

/// Where the kept experts' ids live in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Dense renumbering, router sliced, config count = k (stock vLLM).
    Compact,
    /// Router untouched, config count = E, per-layer compact experts (runtime patch).
    Remap,
}

impl Layout {
    /// `compact` or `remap`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Compact => "compact",
            Layout::Remap => "remap",
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The per-expert scores of one layer under `criterion` (higher is kept first).
/// Each of `counts`, `mass`, `reap` has length `E` or is empty when the
/// criterion does not use it; `random` needs only the length of one of them.
pub fn scores(
    counts: &[f64],
    mass: &[f64],
    reap: &[f64],
    criterion: Criterion,
    seed: u64,
    layer: usize,
) -> Result<Vec<f64>> {
    let e = counts.len().max(mass.len()).max(reap.len());
    for (name, v) in [("counts", counts), ("mass", mass), ("reap", reap)] {
        if !v.is_empty() && v.len() != e {
            return Err(Error::options(
                "router_stats",
                format!("layer {layer}: {name} has {} values, expected {e}", v.len()),
            ));
        }
    }
    let need = |name: &str, v: &[f64]| -> Result<()> {
        if v.len() != e || e == 0 {
            return Err(Error::options(
                "criterion",
                format!(
                    "layer {layer}: criterion {} needs {name} for every expert",
                    criterion.name()
                ),
            ));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::options(
                "router_stats",
                format!("layer {layer}: {name}[{i}] = {} is not finite", v[i]),
            ));
        }
        Ok(())
    };
    Ok(match criterion {
        Criterion::Frequency => {
            need("counts", counts)?;
            counts.to_vec()
        }
        Criterion::Mass => {
            need("mass", mass)?;
            mass.to_vec()
        }
        Criterion::Reap => {
            need("counts", counts)?;
            need("reap", reap)?;
            reap.iter()
                .zip(counts)
                .map(|(r, c)| r / c.max(1.0))
                .collect()
        }
        Criterion::Random => {
            if e == 0 {
                return Err(Error::options("criterion", "no experts to choose from"));
            }
            let base = splitmix(seed ^ splitmix(layer as u64 ^ 0x005E_ED0F_E8E7));
            (0..e)
                .map(|i| (splitmix(base ^ splitmix(i as u64)) >> 11) as f64)
                .collect()
        }
    })
}

/// Ids ordered best first: score descending, ties broken by lower id.
fn ranked(scores: &[f64], ids: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut v: Vec<usize> = ids.collect();
    v.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    v
}

/// The experts one layer keeps, ids ascending: the `keep` best by
/// `criterion`, or with `n_group > 1` the `keep / n_group` best of every
/// original group (group `g` = ids `[g·E/n_group, (g+1)·E/n_group)`).
#[allow(clippy::too_many_arguments)]
pub fn select_experts(
    counts: &[f64],
    mass: &[f64],
    reap: &[f64],
    criterion: Criterion,
    keep: usize,
    n_group: usize,
    seed: u64,
    layer: usize,
) -> Result<Vec<usize>> {
    let s = scores(counts, mass, reap, criterion, seed, layer)?;
    let e = s.len();
    if keep == 0 || keep > e {
        return Err(Error::options(
            "keep_experts",
            format!("layer {layer}: cannot keep {keep} of {e} experts (at least one, at most all)"),
        ));
    }
    let n_group = n_group.max(1);
    let mut out = if n_group == 1 {
        ranked(&s, 0..e).into_iter().take(keep).collect::<Vec<_>>()
    } else {
        if !e.is_multiple_of(n_group) || !keep.is_multiple_of(n_group) {
            return Err(Error::options(
                "keep_experts",
                format!("layer {layer}: {keep} kept of {e} experts cannot be balanced over n_group = {n_group} groups (both must be multiples of it)"),
            ));
        }
        let (size, per) = (e / n_group, keep / n_group);
        (0..n_group)
            .flat_map(|g| ranked(&s, g * size..(g + 1) * size).into_iter().take(per))
            .collect()
    };
    out.sort_unstable();
    Ok(out)
}

/// The fewest experts whose scores (sorted descending) cover `fraction` of
/// the layer's total (negative scores count as 0); at least one.
pub fn keep_for_mass(scores: &[f64], fraction: f32) -> usize {
    let mut v: Vec<f64> = scores.iter().map(|x| x.max(0.0)).collect();
    v.sort_by(|a, b| b.total_cmp(a));
    let total: f64 = v.iter().sum();
    if total <= 0.0 {
        return 1;
    }
    // The fraction comes as f32: allow its rounding (0.8f32 is 0.80000001).
    let target = (f64::from(fraction) - 1e-6) * total;
    let mut cum = 0.0;
    for (i, x) in v.iter().enumerate() {
        cum += x;
        if cum >= target {
            return i + 1;
        }
    }
    v.len().max(1)
}

/// Length-`e` map: compact id (dense in original order) of each kept expert, −1 otherwise.
pub fn expert_map(keep_ids: &[usize], e: usize) -> Vec<i64> {
    let mut m = vec![-1i64; e];
    for (c, &id) in keep_ids.iter().enumerate() {
        if let Some(x) = m.get_mut(id) {
            *x = c as i64;
        }
    }
    m
}

/// Router statistics of an earlier run (`forge/router_stats.safetensors`).
#[derive(Debug, Clone)]
pub struct RouterStats {
    /// The file read.
    pub path: PathBuf,
    /// Decoder layer index of each row.
    pub layers: Vec<usize>,
    /// Routed-token counts, `[L][E]`.
    pub counts: Vec<Vec<f64>>,
    /// Router probability mass, `[L][E]`.
    pub mass: Vec<Vec<f64>>,
    /// Σ router weight × ‖expert output‖, `[L][E]`.
    pub reap: Vec<Vec<f64>>,
    /// `sigmoid` or `softmax`.
    pub scoring: String,
    /// Experts per layer.
    pub num_experts: usize,
    /// `model_type` of the model the statistics came from, when recorded.
    pub model: Option<String>,
}

fn f64s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

impl RouterStats {
    /// Reads and checks the file (tensors, dtypes, shapes, metadata).
    pub fn read(path: &Path) -> Result<RouterStats> {
        let err = |reason: String| Error::config(path, format!("router statistics: {reason}"));
        let meta = std::fs::metadata(path).map_err(Error::io("open router statistics", path))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        let ckpt = Checkpoint::open(path)?;
        let info: Value = match ckpt.metadata().get("forge") {
            Some(s) => serde_json::from_str(s)
                .map_err(|e| err(format!("metadata \"forge\" is not JSON ({e})")))?,
            None => return Err(err(format!("no metadata \"forge\" (expected {{\"format\": \"{STATS_FORMAT}\", ...}}); not a file forge wrote"))),
        };
        if info.get("format").and_then(Value::as_str) != Some(STATS_FORMAT) {
            return Err(err(format!(
                "metadata format is {}, expected \"{STATS_FORMAT}\"",
                info.get("format")
                    .map_or("missing".into(), Value::to_string)
            )));
        }
        let layers_t = ckpt
            .get("layers")
            .ok_or_else(|| err("no tensor \"layers\"".into()))?;
        if layers_t.dtype != Dtype::I64 || layers_t.shape.len() != 1 {
            return Err(err(format!(
                "tensor \"layers\" is {} {:?}, expected I64 [L]",
                layers_t.dtype, layers_t.shape
            )));
        }
        let mut layers = Vec::new();
        for c in layers_t.bytes.chunks_exact(8) {
            let v = i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            let l = usize::try_from(v)
                .map_err(|_| err(format!("tensor \"layers\" holds {v}, not a layer index")))?;
            if layers.contains(&l) {
                return Err(err(format!("tensor \"layers\" lists layer {l} twice")));
            }
            layers.push(l);
        }
        let n = layers.len();
        let mut e = None;
        let mut rows = Vec::new();
        for name in ["counts", "mass", "reap"] {
            let t = ckpt
                .get(name)
                .ok_or_else(|| err(format!("no tensor {name:?}")))?;
            if t.dtype != Dtype::F64 || t.shape.len() != 2 || t.shape[0] != n {
                return Err(err(format!(
                    "tensor {name:?} is {} {:?}, expected F64 [{n}, E] (one row per entry of \"layers\")",
                    t.dtype, t.shape
                )));
            }
            if *e.get_or_insert(t.shape[1]) != t.shape[1] {
                return Err(err(format!(
                    "tensor {name:?} has {} experts per row, the others {}",
                    t.shape[1],
                    e.unwrap_or(0)
                )));
            }
            let v = f64s(t.bytes);
            let w = t.shape[1].max(1);
            let r: Vec<Vec<f64>> = v.chunks(w).map(<[f64]>::to_vec).collect();
            if let Some((i, x)) = v
                .iter()
                .enumerate()
                .find(|(_, x)| !x.is_finite() || **x < 0.0)
            {
                return Err(err(format!(
                    "tensor {name:?} element {i} is {x}, expected a finite non-negative value"
                )));
            }
            rows.push(if n == 0 { Vec::new() } else { r });
        }
        let num_experts = e.unwrap_or(0);
        if let Some(ne) = info.get("num_experts") {
            if ne.as_u64() != Some(num_experts as u64) {
                return Err(err(format!(
                    "metadata num_experts = {ne}, but the tensors hold {num_experts} experts per layer"
                )));
            }
        }
        let mut it = rows.into_iter();
        Ok(RouterStats {
            path: path.into(),
            layers,
            counts: it.next().unwrap_or_default(),
            mass: it.next().unwrap_or_default(),
            reap: it.next().unwrap_or_default(),
            scoring: info
                .get("scoring")
                .and_then(Value::as_str)
                .unwrap_or("")
                .into(),
            num_experts,
            model: info.get("model").and_then(Value::as_str).map(str::to_owned),
        })
    }

    /// The row of decoder layer `layer`.
    pub fn row(&self, layer: usize) -> Option<usize> {
        self.layers.iter().position(|&l| l == layer)
    }

    /// `(counts, mass, reap)` of `layer` (the first row when the file has no such layer;
    /// [`RouterStats::check`] refuses files missing a MoE layer).
    pub fn layer(&self, layer: usize) -> (&[f64], &[f64], &[f64]) {
        let r = self.row(layer).unwrap_or(0);
        (&self.counts[r], &self.mass[r], &self.reap[r])
    }

    /// Checks the statistics against the model: same expert count, same
    /// `model_type` (when recorded), every MoE layer present and nothing else.
    pub fn check(&self, config: &Value, num_experts: usize, moe_layers: &[usize]) -> Result<()> {
        let err = |reason: String| {
            Error::config(
                &self.path,
                format!("router statistics: {reason} (statistics from another model?)"),
            )
        };
        if self.num_experts != num_experts {
            return Err(err(format!(
                "{} experts per layer, the model has {num_experts}",
                self.num_experts
            )));
        }
        if let Some(m) = &self.model {
            let mt = config
                .get("model_type")
                .or_else(|| config.pointer("/text_config/model_type"))
                .and_then(Value::as_str);
            if mt.is_some_and(|t| t != m) {
                return Err(err(format!(
                    "recorded for model_type {m:?}, the model is {:?}",
                    mt.unwrap_or_default()
                )));
            }
        }
        if let Some(l) = self.layers.iter().find(|l| !moe_layers.contains(l)) {
            return Err(err(format!("layer {l} is not an MoE layer of this model")));
        }
        if let Some(l) = moe_layers.iter().find(|l| !self.layers.contains(l)) {
            return Err(Error::config(
                &self.path,
                format!("router statistics: no row for MoE layer {l}"),
            ));
        }
        Ok(())
    }
}

/// FNV-1a of a file's bytes (the router statistics' fingerprint).
pub fn file_fingerprint(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(Error::io("read router statistics", path))?;
    Ok(json!({
        "size": bytes.len(),
        "fnv": format!("{:016x}", crate::run::fnv(&bytes, crate::run::FNV0)),
    }))
}

/// The pruning of a run, decided at `Session::open`.
#[derive(Debug, Clone)]
pub struct PruneSpec {
    /// Output layout.
    pub layout: Layout,
    /// Ranking criterion.
    pub criterion: Criterion,
    /// Routed experts per MoE layer in the source (`E`).
    pub num_experts: usize,
    /// Expert groups of the routing (1: none); the compact layout keeps them balanced.
    pub n_group: usize,
    /// Groups each token may use.
    pub topk_group: usize,
    /// Experts routed per token.
    pub top_k: usize,
    /// Experts kept per MoE decoder layer.
    pub keep: BTreeMap<usize, usize>,
    /// Kept ids of layers bound at open (from router statistics).
    pub bound: BTreeMap<usize, Vec<usize>>,
    /// Whether every layer was bound at open.
    pub bound_at_open: bool,
    /// The config.json key holding the expert count (first present of the family's keys).
    pub count_key: &'static str,
}

impl PruneSpec {
    /// Checks a set of kept ids for `layer`: ascending, unique, in range,
    /// the planned count, and (compact, grouped) the same count from every group.
    pub fn check_keep_ids(&self, layer: usize, ids: &[usize]) -> Result<()> {
        let bad = |reason: String| {
            Error::options("keep_ids", format!("layer {layer}: {reason} (got {ids:?})"))
        };
        let Some(&k) = self.keep.get(&layer) else {
            return Err(Error::options(
                "layer",
                format!(
                    "layer {layer} is not a pruned MoE layer (pruned layers: {:?})",
                    self.keep.keys().collect::<Vec<_>>()
                ),
            ));
        };
        if ids.len() != k {
            return Err(bad(format!("{} ids, the plan keeps {k}", ids.len())));
        }
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("ids must be sorted ascending and unique".into()));
        }
        if let Some(x) = ids.iter().find(|&&x| x >= self.num_experts) {
            return Err(bad(format!(
                "id {x} out of range (the layer has {} experts)",
                self.num_experts
            )));
        }
        if self.layout == Layout::Compact && self.n_group > 1 {
            let size = self.num_experts / self.n_group;
            let per = k / self.n_group;
            for g in 0..self.n_group {
                let n = ids.iter().filter(|&&x| x / size == g).count();
                if n != per {
                    return Err(bad(format!(
                        "group {g} keeps {n} experts; the compact layout keeps {per} from each of the {} groups",
                        self.n_group
                    )));
                }
            }
        }
        Ok(())
    }

    /// The `summary()["pruning"]` form.
    pub fn to_json(&self) -> Value {
        json!({
            "layout": self.layout.name(),
            "criterion": self.criterion.name(),
            "num_experts": self.num_experts,
            "keep": self.keep.iter().map(|(l, k)| (l.to_string(), json!(k))).collect::<serde_json::Map<_, _>>(),
            "n_group": self.n_group,
            "top_k": self.top_k,
            "bound_at_open": self.bound_at_open,
        })
    }
}

/// The uniform keep count asked by the options for `e` experts, and the option that asked it.
fn uniform_keep(
    opts: &Options,
    e: usize,
    n_group: usize,
    layout: Layout,
) -> Option<(usize, &'static str)> {
    if let Some(k) = opts.keep_experts {
        return Some((k, "keep_experts"));
    }
    let r = f64::from(opts.prune_ratio?);
    if layout == Layout::Compact && n_group > 1 {
        let per = ((e / n_group) as f64 * (1.0 - r)).round().max(1.0) as usize;
        Some((per * n_group, "prune_ratio"))
    } else {
        Some((
            ((e as f64) * (1.0 - r)).round().max(1.0) as usize,
            "prune_ratio",
        ))
    }
}

/// Decides the pruning of a run from the options, the model config and the
/// MoE layers found in the checkpoint (`None` when no pruning is asked). With
/// router statistics, every layer is bound here.
pub fn resolve(
    opts: &Options,
    config: &Value,
    arch: &Architecture,
    moe_layers: &[usize],
    cfg_path: &Path,
) -> Result<Option<PruneSpec>> {
    if !opts.prunes() {
        return Ok(None);
    }
    let asked = if opts.keep_mass.is_some() {
        "keep_mass"
    } else if opts.prune_ratio.is_some() {
        "prune_ratio"
    } else {
        "keep_experts"
    };
    let count_key = arch.expert_count_keys.iter().copied().find(|k| {
        config.get(*k).is_some() || config.pointer(&format!("/text_config/{k}")).is_some()
    });
    let (Some(e), Some(count_key)) = (arch.expert_count(config), count_key) else {
        return Err(Error::options(
            asked,
            format!(
                "expert pruning needs a model with routed experts; {} declares none ({} family, looked for {})",
                cfg_path.display(),
                arch.name,
                arch.expert_count_keys.join(", ")
            ),
        ));
    };
    if moe_layers.is_empty() {
        return Err(Error::options(
            asked,
            format!("expert pruning needs routed experts, and the checkpoint holds no `.{}.<id>.` tensor", arch.experts_segment),
        ));
    }
    let dim = |k: &str| config_dim(config, k).map_err(|e| Error::config(cfg_path, e));
    let n_group = dim("n_group")?.unwrap_or(1).max(1);
    let topk_group = dim("topk_group")?.unwrap_or(n_group);
    let top_k = dim("num_experts_per_tok")?.unwrap_or(1);
    let layout = if opts.remap {
        Layout::Remap
    } else {
        Layout::Compact
    };
    let stats = match &opts.router_stats {
        Some(p) => {
            let s = RouterStats::read(p)?;
            s.check(config, e, moe_layers)?;
            let routed = s.counts.iter().flatten().any(|&c| c > 0.0);
            if opts.criterion == Criterion::Reap
                && routed
                && s.reap.iter().flatten().all(|&r| r == 0.0)
            {
                return Err(Error::options(
                    "criterion",
                    format!(
                        "{}: these statistics carry no REAP saliency (collected with sparse_forward, which skips the experts); pick criterion frequency or mass, or collect them without sparse_forward",
                        p.display()
                    ),
                ));
            }
            Some(s)
        }
        None => None,
    };
    let mut keep = BTreeMap::new();
    if let Some(frac) = opts.keep_mass {
        let s = stats.as_ref().ok_or_else(|| {
            Error::options("keep_mass", "needs router_stats (per-layer counts are known only from statistics given up front)")
        })?;
        for &l in moe_layers {
            let (counts, mass, reap) = s.layer(l);
            let sc = scores(counts, mass, reap, opts.criterion, opts.seed, l)?;
            keep.insert(l, keep_for_mass(&sc, frac));
        }
    } else if let Some((k, name)) = uniform_keep(opts, e, n_group, layout) {
        check_keep(k, name, e, n_group, topk_group, top_k, layout)?;
        for &l in moe_layers {
            keep.insert(l, k);
        }
    }
    let mut bound = BTreeMap::new();
    if let Some(s) = &stats {
        let g = if layout == Layout::Compact {
            n_group
        } else {
            1
        };
        for (&l, &k) in &keep {
            let (counts, mass, reap) = s.layer(l);
            let ids = select_experts(counts, mass, reap, opts.criterion, k, g, opts.seed, l)?;
            bound.insert(l, ids);
        }
    }
    Ok(Some(PruneSpec {
        layout,
        criterion: opts.criterion,
        num_experts: e,
        n_group,
        topk_group,
        top_k,
        keep,
        bound_at_open: stats.is_some(),
        bound,
        count_key,
    }))
}

/// Refuses a keep count that vLLM would reject or silently change.
fn check_keep(
    k: usize,
    option: &str,
    e: usize,
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    layout: Layout,
) -> Result<()> {
    let no = |reason: String| {
        Err(Error::options(
            option,
            format!("keeps {k} of {e} experts per layer: {reason}"),
        ))
    };
    if k == 0 {
        return no("at least one expert must stay".into());
    }
    if k > e {
        return no(format!("the model has only {e}"));
    }
    if layout == Layout::Remap {
        return Ok(());
    }
    if k < top_k {
        return no(format!("vLLM routes num_experts_per_tok = {top_k} experts per token, so at least {top_k} must stay (or use remap)"));
    }
    if n_group > 1 {
        if !e.is_multiple_of(n_group) {
            return no(format!(
                "the model's {e} experts do not split into n_group = {n_group} groups"
            ));
        }
        if !k.is_multiple_of(n_group) {
            return no(format!("with group-limited routing (n_group = {n_group}) the compact count must be a multiple of n_group, or vLLM 0.33 silently drops the grouping and 0.11 refuses to load"));
        }
        if k <= n_group {
            return no(format!("each of the n_group = {n_group} groups must keep at least 2 experts (vLLM scores a group by its top-2 experts; 0.33 silently drops the grouping, 0.11 refuses)"));
        }
        if topk_group * (k / n_group) < top_k {
            return no(format!("topk_group = {topk_group} groups of {} experts hold fewer than num_experts_per_tok = {top_k}", k / n_group));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn each_criterion_and_ties() {
        let counts = [5.0, 1.0, 5.0, 0.0, 2.0, 9.0];
        let mass = [0.1, 0.9, 0.2, 0.3, 0.0, 0.05];
        let reap = [10.0, 8.0, 5.0, 0.0, 6.0, 9.0];
        let sel = |c, k| select_experts(&counts, &mass, &reap, c, k, 1, 0, 3).unwrap();
        assert_eq!(sel(Criterion::Frequency, 2), vec![0, 5]);
        // tie 0 and 2 at 5: lower id wins
        assert_eq!(sel(Criterion::Frequency, 3), vec![0, 2, 5]);
        assert_eq!(sel(Criterion::Mass, 2), vec![1, 3]);
        // reap means: 2, 8, 1, 0, 3, 1
        assert_eq!(sel(Criterion::Reap, 2), vec![1, 4]);
        let r1 = sel(Criterion::Random, 3);
        assert_eq!(r1, sel(Criterion::Random, 3));
        assert_eq!(r1.len(), 3);
        let other_layer = select_experts(&counts, &[], &[], Criterion::Random, 3, 1, 0, 4).unwrap();
        let other_seed = select_experts(&counts, &[], &[], Criterion::Random, 3, 1, 1, 3).unwrap();
        assert_eq!(
            r1,
            select_experts(&counts, &[], &[], Criterion::Random, 3, 1, 0, 3).unwrap()
        );
        // 20 draws of 3 of 6 are not all the same
        let mut distinct = std::collections::BTreeSet::new();
        for s in 0..20 {
            distinct
                .insert(select_experts(&counts, &[], &[], Criterion::Random, 3, 1, s, 3).unwrap());
        }
        assert!(
            distinct.len() > 3,
            "{distinct:?} {other_layer:?} {other_seed:?}"
        );
        // all zero: lowest ids
        assert_eq!(
            select_experts(&[0.0; 4], &[], &[], Criterion::Frequency, 2, 1, 0, 0).unwrap(),
            vec![0, 1]
        );
        assert!(select_experts(&counts, &[], &[], Criterion::Mass, 2, 1, 0, 0).is_err());
        assert!(select_experts(&counts, &mass, &reap, Criterion::Mass, 0, 1, 0, 0).is_err());
        assert!(select_experts(&counts, &mass, &reap, Criterion::Mass, 7, 1, 0, 0).is_err());
    }

    #[test]
    fn group_balance() {
        // 8 experts, 2 groups of 4: the best 4 overall are all in group 0
        let counts = [9.0, 8.0, 7.0, 6.0, 1.0, 0.0, 3.0, 2.0];
        let ids = select_experts(&counts, &[], &[], Criterion::Frequency, 4, 2, 0, 0).unwrap();
        assert_eq!(ids, vec![0, 1, 6, 7]);
        let ids = select_experts(&counts, &[], &[], Criterion::Frequency, 4, 1, 0, 0).unwrap();
        assert_eq!(ids, vec![0, 1, 2, 3]);
        assert!(select_experts(&counts, &[], &[], Criterion::Frequency, 3, 2, 0, 0).is_err());
        let r = select_experts(&counts, &[], &[], Criterion::Random, 4, 2, 7, 1).unwrap();
        assert_eq!(r.iter().filter(|&&x| x < 4).count(), 2);
    }

    #[test]
    fn mass_keep_and_map() {
        assert_eq!(keep_for_mass(&[1.0, 5.0, 3.0, 1.0], 0.5), 1);
        assert_eq!(keep_for_mass(&[1.0, 5.0, 3.0, 1.0], 0.8), 2);
        assert_eq!(keep_for_mass(&[1.0, 5.0, 3.0, 1.0], 1.0), 4);
        assert_eq!(keep_for_mass(&[0.0, 5.0, 0.0], 1.0), 1);
        assert_eq!(keep_for_mass(&[0.0, 0.0], 0.5), 1);
        assert_eq!(expert_map(&[1, 3], 5), vec![-1, 0, -1, 1, -1]);
    }

    #[test]
    fn keep_refusals() {
        let c = Layout::Compact;
        assert!(check_keep(4, "keep_experts", 8, 1, 1, 2, c).is_ok());
        let e = check_keep(9, "keep_experts", 8, 1, 1, 2, c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keep_experts") && e.contains("only 8"), "{e}");
        let e = check_keep(1, "keep_experts", 8, 1, 1, 2, c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
        let e = check_keep(6, "keep_experts", 16, 4, 2, 2, c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of n_group"), "{e}");
        let e = check_keep(4, "keep_experts", 16, 4, 2, 2, c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 2"), "{e}");
        let e = check_keep(8, "prune_ratio", 16, 4, 1, 3, c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("prune_ratio") && e.contains("topk_group"), "{e}");
        assert!(check_keep(8, "keep_experts", 16, 4, 2, 3, c).is_ok());
        assert!(check_keep(1, "keep_experts", 16, 4, 2, 3, Layout::Remap).is_ok());
    }
}
