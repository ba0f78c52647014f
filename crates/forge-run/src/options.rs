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
use crate::{Error, Result};

/// How the weights are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Round to nearest on the grid (data-free).
    Rtn,
    /// GPTQ with Hessians from calibration activations (layer by layer, in Python).
    Gptq,
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
        &["calib", "few_tokens_threshold", "threads", "offload_dir"]
    }

    /// The part of the options that decides the output bytes (stored in the
    /// resume manifest; a resume with different values is refused).
    pub fn fingerprint(&self) -> Value {
        let all = self.to_json();
        let mut out = Map::new();
        let gptq = self.method == Method::Gptq;
        for k in BYTE_KEYS
            .iter()
            .chain(if gptq { GPTQ_BYTE_KEYS } else { &[] })
        {
            if let Some(v) = all.get(*k) {
                out.insert((*k).into(), v.clone());
            }
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

    /// Name of the quantizer, for messages and the manifest.
    pub fn quantizer_name(&self) -> String {
        let grid = match self.grid {
            Grid::Range => "range",
            Grid::Mse => "mse",
        };
        match self.method {
            Method::Rtn => format!("rtn-{grid}"),
            Method::Gptq => format!("gptq-{grid}"),
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
}
