//! `verify`: checks that an output directory is a complete, consistent AWQ
//! checkpoint that stock vLLM loads (facts: shared/notes/formats.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use forge_io::{Checkpoint, Dtype, INDEX_FILE, PARTIAL_SUFFIX};
use half::f16;
use serde_json::{json, Value};

use crate::arch::{num_hidden_layers, Architecture};
use crate::run::MANIFEST_FILE;
use crate::{plan, Error, Result};

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Tensors in the checkpoint.
    pub tensors: usize,
    /// Quantized linears (qweight/qzeros/scales triples).
    pub quantized: usize,
    /// Unquantized linear-like modules.
    pub unquantized: usize,
    /// Group size from config.json.
    pub group_size: usize,
    /// Shard files.
    pub shards: usize,
    /// Every problem found (empty: the checkpoint is fine).
    pub problems: Vec<String>,
}

impl VerifyReport {
    /// JSON form.
    pub fn to_json(&self) -> Value {
        json!({
            "ok": self.problems.is_empty(),
            "tensors": self.tensors,
            "quantized": self.quantized,
            "unquantized": self.unquantized,
            "group_size": self.group_size,
            "shards": self.shards,
            "problems": self.problems,
        })
    }
}

/// Verifies `dir`: `Ok` only when no problem was found, else
/// [`Error::Verify`] listing every problem.
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let r = check(dir)?;
    if r.problems.is_empty() {
        Ok(r)
    } else {
        Err(Error::Verify {
            dir: dir.into(),
            problems: r.problems,
        })
    }
}

/// Checks `dir` and lists every problem in the report; an error only when the
/// directory cannot be read as a checkpoint at all.
pub fn check(dir: &Path) -> Result<VerifyReport> {
    let mut r = VerifyReport::default();
    let mut problems: Vec<String> = Vec::new();
    // Leftovers of an unfinished run.
    if dir.join(MANIFEST_FILE).exists() {
        problems.push(format!("{MANIFEST_FILE} is present: the run that wrote this directory did not finish (rerun with --resume)"));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(PARTIAL_SUFFIX) {
                problems.push(format!("{name}: unfinished file of an interrupted run"));
            }
        }
    }
    if !dir.join(INDEX_FILE).is_file() && !dir.join("model.safetensors").is_file() {
        problems.push(format!("no {INDEX_FILE} and no model.safetensors"));
        r.problems = problems;
        return Ok(r);
    }
    let ckpt = Checkpoint::open(dir)?;
    let config = plan::read_config(dir)?;
    r.tensors = ckpt.len();
    r.shards = ckpt.files().count();

    // Index total_size.
    if let Ok(text) = std::fs::read_to_string(dir.join(INDEX_FILE)) {
        let idx: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let total = idx.pointer("/metadata/total_size").and_then(Value::as_u64);
        if total != Some(ckpt.total_bytes()) {
            problems.push(format!(
                "{INDEX_FILE}: metadata.total_size is {total:?}, the shards hold {} tensor bytes",
                ckpt.total_bytes()
            ));
        }
    }

    // config.json.
    if !config.is_object() {
        problems.push("config.json is missing".into());
    }
    let q = config
        .get("quantization_config")
        .cloned()
        .unwrap_or(Value::Null);
    let mut g = 0usize;
    let mut not_convert: Vec<String> = Vec::new();
    if q.is_null() {
        problems.push("config.json has no quantization_config".into());
    } else {
        let want = [
            ("quant_method", json!("awq")),
            ("bits", json!(4)),
            ("zero_point", json!(true)),
            ("version", json!("gemm")),
        ];
        for (k, v) in want {
            if q.get(k) != Some(&v) {
                problems.push(format!(
                    "config.json quantization_config.{k} is {}, expected {v}",
                    q.get(k).map_or("missing".into(), Value::to_string)
                ));
            }
        }
        match q.get("group_size").and_then(Value::as_u64) {
            Some(x) if [32, 64, 128].contains(&x) => g = x as usize,
            Some(x) if x >= 32 && x % 32 == 0 => {
                g = x as usize;
                problems.push(format!(
                    "quantization_config.group_size {x}: vLLM's Marlin kernels need 32, 64 or 128"
                ));
            }
            other => problems.push(format!(
                "quantization_config.group_size is {other:?}, expected 32, 64 or 128"
            )),
        }
        match q.get("modules_to_not_convert") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) => {
                for v in a {
                    match v.as_str() {
                        Some(s) => not_convert.push(s.to_owned()),
                        None => {
                            problems.push(format!("modules_to_not_convert holds a non-string {v}"))
                        }
                    }
                }
            }
            Some(v) => problems.push(format!("modules_to_not_convert is {v}, expected a list")),
        }
    }
    r.group_size = g;
    let skipped = |module: &str| not_convert.iter().any(|s| module.contains(s.as_str()));
    let arch = Architecture::detect(&config);
    let n_layers = num_hidden_layers(&config);
    let n_experts = arch.expert_count(&config);

    // Tensors.
    let mut quantized: BTreeSet<String> = BTreeSet::new();
    for t in ckpt.iter() {
        let name = t.name;
        if matches!(t.dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2) {
            problems.push(format!(
                "{name}: FP8 tensor left in the output ({})",
                t.dtype
            ));
        }
        if name.ends_with("_scale_inv") {
            problems.push(format!("{name}: stray FP8 scale"));
        }
        if let Some(m) = name.strip_suffix(".qweight") {
            quantized.insert(m.to_owned());
        } else if let Some(m) = name
            .strip_suffix(".qzeros")
            .or_else(|| name.strip_suffix(".scales"))
        {
            if ckpt.get(&format!("{m}.qweight")).is_none() {
                problems.push(format!("{name}: no {m}.qweight next to it"));
            }
        } else if name.ends_with(".g_idx") {
            problems.push(format!("{name}: stray g_idx (AWQ has none)"));
        }
    }
    r.quantized = quantized.len();
    for m in &quantized {
        let get = |s: &str| ckpt.get(&format!("{m}.{s}"));
        if get("weight").is_some() {
            problems.push(format!("{m}: both .weight and .qweight"));
        }
        let Some(qw) = get("qweight") else { continue };
        let (Some(qz), Some(sc)) = (get("qzeros"), get("scales")) else {
            problems.push(format!("{m}: qweight without qzeros and scales"));
            continue;
        };
        if skipped(m) {
            problems.push(format!("{m}: quantized, but modules_to_not_convert has an entry that is a substring of its name, so vLLM would load it as unquantized"));
        }
        let &[k, n8] = qw.shape else {
            problems.push(format!(
                "{m}.qweight: shape {:?}, expected [K, N/8]",
                qw.shape
            ));
            continue;
        };
        let n = n8 * 8;
        if qw.dtype != Dtype::I32 || qz.dtype != Dtype::I32 || sc.dtype != Dtype::F16 {
            problems.push(format!(
                "{m}: dtypes qweight {}, qzeros {}, scales {}; expected I32, I32, F16",
                qw.dtype, qz.dtype, sc.dtype
            ));
            continue;
        }
        if g == 0 {
            continue;
        }
        if k % g != 0 || n == 0 {
            problems.push(format!(
                "{m}.qweight: K = {k} is not a multiple of group size {g}"
            ));
            continue;
        }
        if qz.shape != [k / g, n8] {
            problems.push(format!(
                "{m}.qzeros: shape {:?}, expected {:?}",
                qz.shape,
                [k / g, n8]
            ));
        }
        if sc.shape != [k / g, n] {
            problems.push(format!(
                "{m}.scales: shape {:?}, expected {:?}",
                sc.shape,
                [k / g, n]
            ));
        } else if let Some(i) = sc.bytes.chunks_exact(2).position(|b| {
            !(f16::from_le_bytes([b[0], b[1]]).to_f32() > 0.0
                && f16::from_le_bytes([b[0], b[1]]).is_finite())
        }) {
            problems.push(format!(
                "{m}.scales: element {i} is not a positive finite number"
            ));
        }
    }

    // Unquantized linears inside layers must be listed for vLLM.
    for name in ckpt.names() {
        let Some(module) = name.strip_suffix(".weight") else {
            continue;
        };
        let Some(t) = ckpt.get(name) else { continue };
        let Some((_, layer)) = forge_io::split_layer_name(name) else {
            continue;
        };
        if Some(ckpt.layer_prefix().unwrap_or_default())
            != forge_io::split_layer_name(name).map(|(p, _)| p)
        {
            continue;
        }
        let is_router = arch.is_router(module) && t.shape.len() == 2;
        if arch.is_linear(name, t.shape) || is_router {
            r.unquantized += 1;
            if !q.is_null() && !skipped(module) {
                let mtp = arch.has_mtp && n_layers.is_some_and(|n| layer >= n);
                problems.push(format!(
                    "{module}{}: unquantized but not in modules_to_not_convert (vLLM would expect {module}.qweight)",
                    if mtp { " (MTP layer)" } else { "" }
                ));
            }
        }
    }

    // Experts: ids below the configured count, every layer complete and uniform.
    let mut experts: BTreeMap<String, BTreeMap<usize, BTreeSet<String>>> = BTreeMap::new();
    for name in ckpt.names() {
        let Some((experts_mod, e)) = arch.expert_of(name) else {
            continue;
        };
        let rest = &name[experts_mod.len() + 1..];
        let leaf = rest.split_once('.').map_or(rest, |(_, l)| l);
        experts
            .entry(experts_mod.to_owned())
            .or_default()
            .entry(e)
            .or_default()
            .insert(leaf.to_owned());
    }
    for (module, by_id) in &experts {
        if let Some(count) = n_experts {
            if let Some((&bad, _)) = by_id.range(count..).next() {
                problems.push(format!("{module}.{bad}: expert id ≥ the configured expert count {count} (vLLM raises KeyError)"));
            }
            let missing: Vec<usize> = (0..count).filter(|e| !by_id.contains_key(e)).collect();
            if let Some(first) = missing.first() {
                problems.push(format!(
                    "{module}: {} of {count} experts missing, e.g. {first} (vLLM would leave them uninitialised)",
                    missing.len()
                ));
            }
        }
        if let Some((&e0, first)) = by_id.iter().next() {
            for (e, set) in by_id {
                if set != first {
                    problems.push(format!(
                        "{module}.{e}: tensors {set:?} differ from expert {e0}'s {first:?}"
                    ));
                    break;
                }
            }
        }
    }
    r.problems = problems;
    Ok(r)
}
