//! The options of a run, defined once.
//!
//! [`Options`] is the single user-facing description of a quantization run: the
//! command line, the Python API (`forge.quantize_model(**options)`) and the
//! calibrated GPTQ driver all build it from the same flat JSON object, so every
//! knob has one name, one default and one validation. Unknown keys are refused
//! with the list of known ones. What changes the output bytes is
//! [`Options::fingerprint`], stored in the resume manifest; the rest (resume,
//! threads, device, …) only changes how the run goes.

use std::path::PathBuf;

use forge_core::grid::GridMode;
use forge_core::MseSpec;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::format::OutputFormat;
use crate::plan::QuantOptions;
pub use crate::prune::Criterion;
use crate::{Error, Result};

/// How the weights are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Round to nearest on the grid (data-free).
    Rtn,
    /// GPTQ with Hessians from calibration activations (layer by layer, in Python).
    Gptq,
    /// No quantization: every tensor copied (FP8 → bf16), no `quantization_config`
    /// (for pruning alone).
    None,
}

/// How each group's scale and zero point are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Grid {
    /// The group's range (including 0).
    Range,
    /// The range, refined by the MSE / L^p shrink search.
    Mse,
}

/// The Hessian kept per linear in a GPTQ run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HessianForm {
    /// The whole `K × K` Hessian.
    Full,
    /// Only its diagonal `G × G` blocks (`K/G` blocks): a fraction `G/K` of the memory.
    Block,
}

/// What a routed expert with too few calibration tokens is quantized with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FewTokens {
    /// GPTQ with the Hessian pooled over all experts of the layer.
    Pooled,
    /// Round to nearest on the grid.
    Rtn,
}

/// Shard size: bytes, or a string such as `5GB`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Size {
    /// Plain bytes.
    Bytes(u64),
    /// `5GB`, `500MB`, `2GiB`.
    Text(String),
}

/// Every option of a run. Field names are the keys of the JSON form, the
/// Python keyword arguments and (with `-` for `_`) the command-line flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    /// `rtn` (data-free) or `gptq` (calibrated).
    pub method: Method,
    /// Output checkpoint format: `awq`, `gptq` (v1, symmetric only) or `compressed-tensors`.
    pub format: OutputFormat,
    /// Group size along the input dimension: 32, 64 or 128 (what vLLM loads).
    pub group_size: usize,
    /// Symmetric grid (zero point 8) instead of asymmetric.
    pub symmetric: bool,
    /// Scale choice: `range` or `mse`.
    pub grid: Grid,
    /// MSE grid: number of candidate scales.
    pub mse_grid: usize,
    /// MSE grid: candidates span `[1 - s, 1 + s]` times the range scale.
    pub mse_shrink: f32,
    /// MSE grid: exponent `p` of the loss `Σ|e|^p`.
    pub mse_norm: f32,
    /// Module patterns to quantize (all when empty).
    pub include: Vec<String>,
    /// Module patterns to leave unquantized.
    pub exclude: Vec<String>,
    /// Apply the family's default exclusions (DeepSeek: `kv_b_proj`).
    pub default_excludes: bool,
    /// Leave linears whose shape cannot be packed unquantized instead of failing.
    pub skip_unpackable: bool,
    /// Maximum tensor bytes per output shard.
    pub max_shard_size: Size,

    /// GPTQ: calibration file (plain text, `.jsonl` with a `text` field, or token ids).
    pub calib: Option<PathBuf>,
    /// GPTQ: calibration windows.
    pub nsamples: usize,
    /// GPTQ: tokens per window.
    pub seqlen: usize,
    /// GPTQ: seed of the window sampling.
    pub seed: u64,
    /// GPTQ: relative damping (fraction of the mean Hessian diagonal).
    pub damp: f32,
    /// GPTQ: process inputs by descending Hessian diagonal (static groups: no `g_idx`).
    pub act_order: bool,
    /// GPTQ: columns per lazy-update block.
    pub block_size: usize,
    /// GPTQ: quantize a layer's linears in forward order, each seeing the quantized
    /// outputs of the ones before it.
    pub true_sequential: bool,
    /// GPTQ: `full` or `block` (block-diagonal) Hessians.
    pub hessian: HessianForm,
    /// GPTQ: fallback for experts with too few routed tokens.
    pub few_tokens: FewTokens,
    /// GPTQ: an expert with fewer routed tokens than this takes the fallback
    /// (default: its input dimension / 8).
    pub few_tokens_threshold: Option<usize>,
    /// GPTQ: tokens per forward chunk (memory of the activations in flight).
    pub chunk_tokens: usize,

    /// Continue an interrupted run in the output folder.
    pub resume: bool,
    /// Replace the files of a non-empty output folder.
    pub overwrite: bool,
    /// Worker threads (all cores when absent).
    pub threads: Option<usize>,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// GPTQ: where calibration activations live: `auto`, `gpu`, `cpu` or `disk`.
    pub activations: String,
    /// GPTQ: folder for activations on disk (default: inside the output folder).
    pub offload_dir: Option<PathBuf>,
    /// Show progress bars.
    pub progress: bool,

    /// Pruning: routed experts kept per MoE layer.
    pub keep_experts: Option<usize>,
    /// Pruning: fraction of the routed experts pruned, in (0, 1) (exclusive with
    /// keep_experts; see `forge_run::prune` for the rounding).
    pub prune_ratio: Option<f32>,
    /// Pruning: how experts are ranked: `reap`, `frequency`, `mass` or `random`.
    pub criterion: Criterion,
    /// Pruning: remap layout (router untouched, per-layer counts; needs the
    /// runtime patch) instead of the compact one stock vLLM loads.
    pub remap: bool,
    /// Pruning: per-layer keep count = fewest experts whose scores cover this
    /// fraction of the layer's total, in (0, 1] (remap and router_stats only).
    pub keep_mass: Option<f32>,
    /// Calibration forward without the routed experts (faster; not with criterion reap).
    pub sparse_forward: bool,
    /// Only collect router statistics (`forge/router_stats.safetensors`); needs calib.
    pub stats_only: bool,
    /// Pruning: `router_stats.safetensors` of an earlier run to prune from
    /// (no calibration needed for the expert map).
    pub router_stats: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        let mse = MseSpec::default();
        Options {
            method: Method::Rtn,
            format: OutputFormat::Awq,
            group_size: 128,
            symmetric: false,
            grid: Grid::Range,
            mse_grid: mse.n_grid,
            mse_shrink: mse.max_shrink,
            mse_norm: mse.norm,
            include: Vec::new(),
            exclude: Vec::new(),
            default_excludes: true,
            skip_unpackable: false,
            max_shard_size: Size::Text("5GB".into()),
            calib: None,
            nsamples: 128,
            seqlen: 512,
            seed: 0,
            damp: 0.01,
            act_order: false,
            block_size: 128,
            true_sequential: true,
            hessian: HessianForm::Full,
            few_tokens: FewTokens::Pooled,
            few_tokens_threshold: None,
            chunk_tokens: 8192,
            resume: false,
            overwrite: false,
            threads: None,
            device: "cpu".into(),
            activations: "auto".into(),
            offload_dir: None,
            progress: true,
            keep_experts: None,
            prune_ratio: None,
            criterion: Criterion::Reap,
            remap: false,
            keep_mass: None,
            sparse_forward: false,
            stats_only: false,
            router_stats: None,
        }
    }
}

/// Keys that change the output bytes of a run whatever the method.
const BYTE_KEYS: &[&str] = &[
    "method",
    "format",
    "group_size",
    "symmetric",
    "grid",
    "mse_grid",
    "mse_shrink",
    "mse_norm",
    "include",
    "exclude",
    "default_excludes",
    "skip_unpackable",
    "max_shard_size",
];
/// Keys that change the output bytes of a pruning (or statistics) run.
const PRUNE_BYTE_KEYS: &[&str] = &[
    "keep_experts",
    "prune_ratio",
    "criterion",
    "remap",
    "keep_mass",
    "sparse_forward",
    "stats_only",
];
/// Keys that change the output bytes of a GPTQ run.
const GPTQ_BYTE_KEYS: &[&str] = &[
    "nsamples",
    "seqlen",
    "seed",
    "damp",
    "act_order",
    "block_size",
    "true_sequential",
    "hessian",
    "few_tokens",
    "few_tokens_threshold",
];

impl Options {
    /// Parses a flat JSON object (absent keys take their defaults) and validates it.
    pub fn from_json(v: &Value) -> Result<Options> {
        let obj = v
            .as_object()
            .ok_or_else(|| Error::options("options", "expected an object of option: value"))?;
        let known = Self::keys();
        if let Some(k) = obj.keys().find(|k| !known.contains(k)) {
            return Err(Error::options(
                k,
                format!("unknown option; known options: {}", known.join(", ")),
            ));
        }
        // An explicit null is a value only for optional options; elsewhere it is
        // a mistake (e.g. `group_size=None`), named rather than silently defaulted.
        let defaults = Options::default().to_json();
        let mut clean = Map::new();
        for (k, x) in obj {
            if x.is_null() && !Self::optional_keys().contains(&k.as_str()) {
                let d = defaults
                    .get(k)
                    .map_or_else(String::new, |d| format!(" ({d})"));
                return Err(Error::options(
                    k,
                    format!("None/null is not a value of {k}; leave it out for the default{d}"),
                ));
            }
            clean.insert(k.clone(), x.clone());
        }
        // One key at a time first, so a wrong type names its option.
        for (k, x) in &clean {
            let mut one = Map::new();
            one.insert(k.clone(), x.clone());
            serde_json::from_value::<Options>(Value::Object(one))
                .map_err(|e| Error::options(k, format!("{e} (got {x})")))?;
        }
        let o: Options = serde_json::from_value(Value::Object(clean))
            .map_err(|e| Error::options("options", e.to_string()))?;
        o.validate()?;
        Ok(o)
    }

    /// The canonical JSON form (every key, defaults filled in).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Every option key (the fields of [`Options`], sorted).
    pub fn keys() -> Vec<String> {
        match Options::default().to_json() {
            Value::Object(m) => m.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    fn optional_keys() -> &'static [&'static str] {
        &[
            "calib",
            "few_tokens_threshold",
            "threads",
            "offload_dir",
            "keep_experts",
            "prune_ratio",
            "keep_mass",
            "router_stats",
        ]
    }

    /// The part of the options that decides the output bytes (stored in the
    /// resume manifest; a resume with different values is refused).
    pub fn fingerprint(&self) -> Value {
        let all = self.to_json();
        let mut out = Map::new();
        // The calibration forward decides the bytes (GPTQ Hessians, router statistics).
        let gptq = self.method == Method::Gptq || self.uses_calibration();
        let prune = self.prunes() || self.stats_only;
        for k in BYTE_KEYS
            .iter()
            .chain(if gptq { GPTQ_BYTE_KEYS } else { &[] })
            .chain(if prune { PRUNE_BYTE_KEYS } else { &[] })
        {
            if let Some(v) = all.get(*k) {
                out.insert((*k).into(), v.clone());
            }
        }
        if prune && self.criterion == Criterion::Random {
            out.insert("seed".into(), json!(self.seed));
        }
        if let Some(p) = &self.router_stats {
            // The content decides the expert map, not the path.
            out.insert(
                "router_stats".into(),
                crate::prune::file_fingerprint(p).unwrap_or_else(|e| json!(e.to_string())),
            );
        }
        if gptq {
            out.insert(
                "calib".into(),
                json!(self.calib.as_ref().map(|p| p.display().to_string())),
            );
        }
        // The resolved shard size, not its spelling.
        out.insert("max_shard_size".into(), json!(self.max_shard_bytes().ok()));
        Value::Object(out)
    }

    /// The shard size in bytes.
    pub fn max_shard_bytes(&self) -> Result<u64> {
        match &self.max_shard_size {
            Size::Bytes(0) => Err(Error::options("max_shard_size", "must be positive")),
            Size::Bytes(b) => Ok(*b),
            Size::Text(s) => crate::cli::parse_size(s),
        }
    }

    /// The grid mode of the forge-core maths.
    pub fn grid_mode(&self) -> Result<GridMode> {
        Ok(match self.grid {
            Grid::Range => GridMode::Range,
            Grid::Mse => {
                let m = MseSpec {
                    max_shrink: self.mse_shrink,
                    n_grid: self.mse_grid,
                    norm: self.mse_norm,
                };
                m.validate()
                    .map_err(|e| Error::options("mse_grid", e.to_string()))?;
                GridMode::Mse(m)
            }
        })
    }

    /// The CUDA device, if any.
    pub fn cuda_device(&self) -> Result<Option<usize>> {
        crate::cli::parse_device(&self.device)
    }

    /// The plan-facing options.
    pub fn quant(&self) -> Result<QuantOptions> {
        Ok(QuantOptions {
            format: self.format,
            group_size: self.group_size,
            symmetric: self.symmetric,
            grid: self.grid_mode()?,
            include: crate::cli::patterns("include", &self.include)?,
            exclude: crate::cli::patterns("exclude", &self.exclude)?,
            default_excludes: self.default_excludes,
            skip_unpackable: self.skip_unpackable,
            max_shard_bytes: self.max_shard_bytes()?,
            quantize: self.method != Method::None,
            stats_only: self.stats_only,
        })
    }

    /// Checks every value (before any file is touched).
    pub fn validate(&self) -> Result<()> {
        self.quant()?;
        self.cuda_device()?;
        crate::verify::check_quant_options(&self.quant()?)?;
        self.format
            .check_options(self.symmetric)
            .map_err(|e| Error::options("format", e))?;
        if let Some(t) = self.threads {
            if t == 0 {
                return Err(Error::options("threads", "must be at least 1"));
            }
            crate::cli::check_threads(t)?;
        }
        if self.method == Method::Gptq {
            if self.nsamples == 0 {
                return Err(Error::options("nsamples", "must be at least 1"));
            }
            if self.seqlen < 2 {
                return Err(Error::options("seqlen", "must be at least 2 tokens"));
            }
            if !(self.damp.is_finite() && self.damp > 0.0 && self.damp < 1.0) {
                return Err(Error::options(
                    "damp",
                    format!("must be in (0, 1), got {}", self.damp),
                ));
            }
            if self.block_size == 0 || self.block_size > 4096 {
                return Err(Error::options(
                    "block_size",
                    format!("must be between 1 and 4096, got {}", self.block_size),
                ));
            }
            if self.chunk_tokens == 0 {
                return Err(Error::options("chunk_tokens", "must be at least 1"));
            }
            if self.hessian == HessianForm::Block && self.act_order {
                return Err(Error::options(
                    "hessian",
                    "block Hessians keep only the diagonal blocks of the group order; they cannot be combined with act_order",
                ));
            }
        }
        self.validate_pruning()?;
        if !["auto", "gpu", "cpu", "disk"].contains(&self.activations.as_str()) {
            return Err(Error::options(
                "activations",
                format!(
                    "expected auto, gpu, cpu or disk, got {:?}",
                    self.activations
                ),
            ));
        }
        Ok(())
    }

    /// Whether expert pruning is asked (keep_experts, prune_ratio or keep_mass).
    pub fn prunes(&self) -> bool {
        self.keep_experts.is_some() || self.prune_ratio.is_some() || self.keep_mass.is_some()
    }

    /// Whether the run needs the calibration forward (in Python): GPTQ,
    /// router statistics only, or pruning with calib (or without router_stats).
    pub fn uses_calibration(&self) -> bool {
        self.method == Method::Gptq
            || self.stats_only
            || (self.prunes() && (self.router_stats.is_none() || self.calib.is_some()))
    }

    /// The model-independent checks of the pruning options (the keep count
    /// against the model's routing is checked when the run opens).
    fn validate_pruning(&self) -> Result<()> {
        if let Some(k) = self.keep_experts {
            if k == 0 {
                return Err(Error::options("keep_experts", "must be at least 1"));
            }
        }
        if let Some(r) = self.prune_ratio {
            if !(r.is_finite() && r > 0.0 && r < 1.0) {
                return Err(Error::options(
                    "prune_ratio",
                    format!("the fraction of experts pruned must be in (0, 1), got {r}"),
                ));
            }
            if self.keep_experts.is_some() {
                return Err(Error::options(
                    "prune_ratio",
                    "give keep_experts or prune_ratio, not both",
                ));
            }
        }
        if let Some(m) = self.keep_mass {
            if !(m.is_finite() && m > 0.0 && m <= 1.0) {
                return Err(Error::options(
                    "keep_mass",
                    format!("must be in (0, 1], got {m}"),
                ));
            }
            if self.keep_experts.is_some() || self.prune_ratio.is_some() {
                return Err(Error::options(
                    "keep_mass",
                    "gives per-layer keep counts; it cannot be combined with keep_experts or prune_ratio",
                ));
            }
            if !self.remap {
                return Err(Error::options(
                    "keep_mass",
                    "per-layer keep counts need the remap layout (vLLM's compact layout has one expert count for every layer): add remap",
                ));
            }
            if self.router_stats.is_none() {
                return Err(Error::options(
                    "keep_mass",
                    "needs router_stats (the per-layer counts must be known when the run opens)",
                ));
            }
            if self.criterion == Criterion::Random {
                return Err(Error::options(
                    "keep_mass",
                    "random scores cover no meaningful mass; pick criterion reap, frequency or mass",
                ));
            }
        }
        if self.sparse_forward
            && self.criterion == Criterion::Reap
            && self.prunes()
            && self.router_stats.is_none()
        {
            return Err(Error::options(
                "sparse_forward",
                "skips the routed experts in the calibration forward, and criterion reap needs their outputs; pick criterion frequency, mass or random",
            ));
        }
        if self.stats_only {
            if self.prunes() {
                return Err(Error::options(
                    "stats_only",
                    "produces only router statistics; it cannot be combined with keep_experts, prune_ratio or keep_mass",
                ));
            }
            if self.calib.is_none() {
                return Err(Error::options(
                    "stats_only",
                    "needs calib (the statistics come from a calibration forward)",
                ));
            }
            if self.router_stats.is_some() {
                return Err(Error::options(
                    "stats_only",
                    "collects router statistics; router_stats (statistics given up front) makes no sense with it",
                ));
            }
        }
        if self.prunes() && self.calib.is_none() && self.router_stats.is_none() {
            let k = if self.keep_experts.is_some() {
                "keep_experts"
            } else if self.prune_ratio.is_some() {
                "prune_ratio"
            } else {
                "keep_mass"
            };
            return Err(Error::options(
                k,
                "expert pruning needs calib (a calibration forward scores the experts) or router_stats (scores of an earlier run)",
            ));
        }
        if let Some(p) = &self.router_stats {
            if !p.is_file() {
                return Err(Error::options(
                    "router_stats",
                    format!("{} is not a file", p.display()),
                ));
            }
        }
        Ok(())
    }

    /// Name of the quantizer, for messages and the manifest.
    pub fn quantizer_name(&self) -> String {
        let grid = match self.grid {
            Grid::Range => "range",
            Grid::Mse => "mse",
        };
        match self.method {
            Method::Rtn => format!("rtn-{grid}"),
            Method::Gptq => format!("gptq-{grid}"),
            Method::None => "none".into(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn defaults_round_trip_and_unknown_keys_are_named() {
        let d = Options::from_json(&json!({})).unwrap();
        assert_eq!(d, Options::default());
        assert_eq!(Options::from_json(&d.to_json()).unwrap(), d);
        let e = Options::from_json(&json!({"grup_size": 64}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("grup_size") && e.contains("group_size"), "{e}");
        let e = Options::from_json(&json!({"group_size": "x"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("group_size"), "{e}");
        for bad in [
            json!(-5),
            json!("-5"),
            json!("-5GB"),
            json!(1.5),
            json!([1]),
        ] {
            let e = Options::from_json(&json!({ "max_shard_size": bad }))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("max_shard_size") && !e.contains("unit"),
                "{bad}: {e}"
            );
        }
        let e = Options::from_json(&json!({"group_size": null}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("group_size") && e.contains("default"), "{e}");
        let e = Options::from_json(&json!({"threads": "x"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("threads"), "{e}");
        assert!(Options::from_json(&json!({"threads": null, "calib": null})).is_ok());
    }

    #[test]
    fn fingerprint_holds_what_changes_bytes() {
        let a = Options::from_json(&json!({"method": "gptq", "calib": "c.txt"})).unwrap();
        let mut b = a.clone();
        b.threads = Some(2);
        b.resume = true;
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.nsamples = 7;
        assert_ne!(a.fingerprint(), b.fingerprint());
        let rtn = Options::default();
        assert!(rtn.fingerprint().get("nsamples").is_none());
        assert_eq!(
            Options::from_json(&json!({"max_shard_size": "5GB"}))
                .unwrap()
                .fingerprint(),
            Options::from_json(&json!({"max_shard_size": 5_000_000_000u64}))
                .unwrap()
                .fingerprint()
        );
    }

    #[test]
    fn bad_values_name_the_option() {
        for (k, v) in [
            ("threads", json!(0)),
            ("threads", json!(1_000_000)),
            ("device", json!("tpu")),
            ("activations", json!("nowhere")),
        ] {
            let e = Options::from_json(&json!({k: v})).unwrap_err().to_string();
            assert!(e.contains(k), "{k}: {e}");
        }
        let e = Options::from_json(&json!({"format": "gptq"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("format") && e.contains("sym"), "{e}");
        let e = Options::from_json(&json!({"format": "exl2"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("format"), "{e}");
        for f in ["awq", "gptq", "compressed-tensors"] {
            let o = Options::from_json(&json!({"format": f, "symmetric": true})).unwrap();
            assert_eq!(o.fingerprint()["format"], json!(f));
        }
        let e = Options::from_json(&json!({"method": "gptq", "damp": 0.0}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("damp"), "{e}");
    }

    #[test]
    fn pruning_refusals_name_the_option() {
        let dir = tempfile::tempdir().unwrap();
        let st = dir.path().join("s.safetensors");
        std::fs::write(&st, b"x").unwrap();
        let st = st.display().to_string();
        for (v, k) in [
            (json!({"keep_experts": 0, "calib": "c"}), "keep_experts"),
            (json!({"prune_ratio": 1.0, "calib": "c"}), "prune_ratio"),
            (json!({"prune_ratio": 0.0, "calib": "c"}), "prune_ratio"),
            (
                json!({"prune_ratio": 0.5, "keep_experts": 4, "calib": "c"}),
                "prune_ratio",
            ),
            (json!({"keep_experts": 4}), "keep_experts"),
            (
                json!({"keep_mass": 0.9, "remap": true, "calib": "c"}),
                "keep_mass",
            ),
            (json!({"keep_mass": 0.9, "router_stats": st}), "keep_mass"),
            (
                json!({"keep_mass": 1.5, "remap": true, "router_stats": st}),
                "keep_mass",
            ),
            (
                json!({"keep_mass": 0.5, "keep_experts": 2, "remap": true, "router_stats": st}),
                "keep_mass",
            ),
            (
                json!({"keep_mass": 0.5, "remap": true, "router_stats": st, "criterion": "random"}),
                "keep_mass",
            ),
            (
                json!({"sparse_forward": true, "calib": "c", "keep_experts": 2}),
                "sparse_forward",
            ),
            (json!({"stats_only": true}), "stats_only"),
            (
                json!({"stats_only": true, "calib": "c", "keep_experts": 2}),
                "stats_only",
            ),
            (
                json!({"router_stats": "/nonexistent/s.safetensors", "keep_experts": 2}),
                "router_stats",
            ),
            (json!({"criterion": "loudest"}), "criterion"),
        ] {
            let e = Options::from_json(&v).unwrap_err().to_string();
            assert!(e.contains(k), "{v}: {e}");
        }
        let ok = Options::from_json(&json!({"keep_mass": 0.5, "remap": true, "router_stats": st}))
            .unwrap();
        assert!(ok.prunes() && !ok.uses_calibration());
        let sparse = Options::from_json(
            &json!({"sparse_forward": true, "criterion": "frequency", "calib": "c", "keep_experts": 2}),
        )
        .unwrap();
        assert!(sparse.uses_calibration());
        let none = Options::from_json(&json!({"method": "none"})).unwrap();
        assert_eq!(none.quantizer_name(), "none");
        assert!(!none.quant().unwrap().quantize);
        // Pruning keys and the statistics' content are byte keys.
        let a = Options::from_json(&json!({"keep_experts": 4, "router_stats": st})).unwrap();
        let b = Options::from_json(&json!({"keep_experts": 5, "router_stats": st})).unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        let before = a.fingerprint();
        std::fs::write(&st, b"y2").unwrap();
        assert_ne!(before, a.fingerprint());
        assert!(Options::default()
            .fingerprint()
            .get("keep_experts")
            .is_none());
    }
}
