//! `verify`: checks that an output directory is a complete, consistent 4-bit
//! checkpoint (AWQ, GPTQ v1 or compressed-tensors, see [`crate::format`]) that
//! stock vLLM loads (facts: shared/notes/formats.md).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use forge_io::{Checkpoint, Dtype, INDEX_FILE, PARTIAL_SUFFIX};
use half::f16;
use serde_json::{json, Value};

use crate::arch::{config_dim, expected_linears, num_hidden_layers, Architecture, MAX_CONFIG_DIM};
use crate::format::{parse_gptq_skip_rule, OutputFormat};
use crate::plan::QuantOptions;
use crate::run::MANIFEST_FILE;
use crate::{Error, Result};

/// Group sizes vLLM loads 4-bit checkpoints with (its Marlin kernels).
pub const VLLM_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// Largest JSON metadata file (`config.json`, the index) `verify` reads.
pub const MAX_JSON_BYTES: u64 = 256 << 20;

/// At most this many problems of one kind are listed one by one.
const MAX_LISTED: usize = 20;

/// Plan-time check of a group size, shared by `quantize` (call it from
/// `plan::build`) and `verify`: only 32, 64 and 128 load in vLLM.
pub fn check_vllm_group_size(group_size: usize) -> Result<()> {
    if VLLM_GROUP_SIZES.contains(&group_size) {
        Ok(())
    } else {
        Err(Error::options(
            "group_size",
            format!("{group_size}: vLLM loads 4-bit AWQ, GPTQ and compressed-tensors checkpoints with group size 32, 64 or 128 only"),
        ))
    }
}

/// Plan-time checks of the options of a run whose output must load in vLLM
/// (group size, grid parameters). `plan::build` should call this first.
pub fn check_quant_options(opts: &QuantOptions) -> Result<()> {
    check_vllm_group_size(opts.group_size)?;
    opts.grid_spec()
        .validate()
        .map_err(|e| Error::options("group_size", e.to_string()))?;
    if let forge_core::grid::GridMode::Mse(m) = opts.grid {
        m.validate()
            .map_err(|e| Error::options("grid", e.to_string()))?;
    }
    Ok(())
}

/// Reads a JSON file that must be a regular file of at most `limit` bytes
/// (never blocks on a named pipe, never reads an unbounded file).
/// `Ok(None)` when it does not exist.
pub fn read_json_file(path: &Path, limit: u64) -> Result<Option<Value>> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("stat", path)(e)),
    };
    if !meta.is_file() {
        return Err(Error::config(path, "not a regular file"));
    }
    if meta.len() > limit {
        return Err(Error::config(
            path,
            format!("{} bytes, more than the {limit} accepted", meta.len()),
        ));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_string(&mut text))
        .map_err(Error::io("read", path))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::config(path, e.to_string()))?;
    Ok(Some(v))
}

/// Index of the first non-finite element of a float tensor's little-endian
/// bytes, scanned in fixed chunks; `None` for non-float dtypes.
fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<usize> {
    const CHUNK: usize = 1 << 20;
    let (width, is_bad): (usize, fn(&[u8]) -> bool) = match dtype {
        Dtype::F32 => (4, |b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7F80_0000 == 0x7F80_0000
        }),
        Dtype::F16 => (2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00),
        Dtype::BF16 => (2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80),
        Dtype::F64 => (8, |b| {
            let v = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            v & 0x7FF0_0000_0000_0000 == 0x7FF0_0000_0000_0000
        }),
        _ => return None,
    };
    let mut base = 0;
    for chunk in bytes.chunks(CHUNK - CHUNK % width) {
        if let Some(i) = chunk.chunks_exact(width).position(is_bad) {
            return Some(base + i);
        }
        base += chunk.len() / width;
    }
    None
}

/// Pushes `msg` unless `MAX_LISTED` problems of this `kind` were listed;
/// returns how many were suppressed so far (reported once at the end).
fn push_capped(
    problems: &mut Vec<String>,
    counts: &mut BTreeMap<&'static str, usize>,
    kind: &'static str,
    msg: String,
) {
    let c = counts.entry(kind).or_insert(0);
    *c += 1;
    if *c <= MAX_LISTED {
        problems.push(msg);
    }
}

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Tensors in the checkpoint.
    pub tensors: usize,
    /// Quantized linears (their primary tensor: `qweight` or `weight_packed`).
    pub quantized: usize,
    /// Unquantized linear-like modules.
    pub unquantized: usize,
    /// Group size from config.json.
    pub group_size: usize,
    /// Output format from config.json (`awq`, `gptq`, `compressed-tensors`).
    pub format: String,
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
            "format": self.format,
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
    if !dir.join("config.json").exists()
        && !dir.join(INDEX_FILE).exists()
        && !dir.join("model.safetensors").exists()
        && dir.join(crate::prune::STATS_FILE).is_file()
    {
        problems.push(format!(
            "holds router statistics only ({}, from a stats_only run), not a checkpoint",
            crate::prune::STATS_FILE
        ));
        r.format = "none".into();
        r.problems = problems;
        return Ok(r);
    }
    let config = match read_json_file(&dir.join("config.json"), MAX_JSON_BYTES) {
        Ok(v) => v.unwrap_or(Value::Null),
        Err(e) => {
            problems.push(e.to_string());
            Value::Null
        }
    };
    let index_path = dir.join(INDEX_FILE);
    let index = match read_json_file(&index_path, MAX_JSON_BYTES) {
        Ok(v) => v,
        Err(e) => {
            problems.push(e.to_string());
            r.problems = problems;
            return Ok(r);
        }
    };
    if index.is_none() && !dir.join("model.safetensors").is_file() {
        problems.push(format!("no {INDEX_FILE} and no model.safetensors"));
        r.problems = problems;
        return Ok(r);
    }
    let ckpt = Checkpoint::open(dir)?;
    r.tensors = ckpt.len();
    r.shards = ckpt.files().count();
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();

    // Shard files the index does not reference (vLLM loads only indexed ones),
    // and non-regular files posing as shards.
    let referenced: BTreeSet<std::ffi::OsString> = ckpt
        .files()
        .filter_map(|f| f.file_name().map(ToOwned::to_owned))
        .collect();
    if let Ok(rd) = std::fs::read_dir(dir) {
        let mut stray: Vec<String> = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().ends_with(".safetensors") {
                continue;
            }
            let regular = std::fs::metadata(e.path()).is_ok_and(|m| m.is_file());
            if !regular {
                stray.push(format!("{}: not a regular file", name.to_string_lossy()));
            } else if !referenced.contains(&name) {
                stray.push(format!(
                    "{}: shard file not referenced by {INDEX_FILE}; vLLM ignores it, so its tensors would be missing",
                    name.to_string_lossy()
                ));
            }
        }
        stray.sort();
        for m in stray {
            push_capped(&mut problems, &mut counts, "stray shard", m);
        }
    }

    // Index total_size.
    if let Some(idx) = &index {
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
    let mut format = OutputFormat::Awq;
    let mut symmetric = false;
    let mut not_convert: Vec<String> = Vec::new();
    let unquantized_copy = q.is_null() && !ckpt.names().any(|n| quantized_part(n).is_some());
    if unquantized_copy {
        // An unquantized output (method none): nothing to check in a quantization_config.
    } else if q.is_null() {
        problems.push("config.json has no quantization_config".into());
    } else {
        let method = q.get("quant_method").and_then(Value::as_str);
        match method.and_then(OutputFormat::from_quant_method) {
            Some(f) => format = f,
            None => problems.push(format!(
                "config.json quantization_config.quant_method is {}, expected \"awq\", \"gptq\" or \"compressed-tensors\"",
                q.get("quant_method").map_or("missing".into(), Value::to_string)
            )),
        }
        let (g_read, sym) = check_quant_config(format, &q, &mut not_convert, &mut problems);
        g = g_read;
        symmetric = sym;
    }
    r.group_size = g;
    r.format = if unquantized_copy {
        "none".into()
    } else {
        format.name().into()
    };
    let skipped = |module: &str| not_convert.iter().any(|s| format.skips(s, module));
    let arch = Architecture::detect(&config);
    let n_layers = num_hidden_layers(&config).filter(|&n| {
        let ok = n <= MAX_CONFIG_DIM;
        if !ok {
            problems.push(format!(
                "config.json num_hidden_layers = {n} is implausible"
            ));
        }
        ok
    });
    let n_experts = arch.expert_count(&config).filter(|&n| {
        let ok = n <= crate::arch::MAX_EXPERTS;
        if !ok {
            problems.push(format!(
                "config.json declares {n} routed experts, more than {} (not a real model)",
                crate::arch::MAX_EXPERTS
            ));
        }
        ok
    });

    // Tensors.
    let primary = format.primary();
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
        let Some((m, suffix)) = quantized_part(name) else {
            continue;
        };
        if !format.all_suffixes().contains(&suffix) {
            problems.push(format!(
                "{name} ({}): a .{suffix} tensor does not belong to format {} (vLLM raises KeyError on it)",
                t.file.display(),
                format.name()
            ));
        } else if suffix == primary {
            quantized.insert(m.to_owned());
        } else if ckpt.get(&format!("{m}.{primary}")).is_none() {
            problems.push(format!(
                "{name} ({}): no {m}.{primary} next to it",
                t.file.display()
            ));
        }
    }
    r.quantized = quantized.len();
    for m in &quantized {
        check_quantized_linear(&ckpt, format, m, g, symmetric, &mut problems);
        if skipped(m) {
            problems.push(format!(
                "{m}: quantized, but an entry of quantization_config.{} matches it, so vLLM would load it as unquantized",
                format.skip_list_name()
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
                    "{module}{}: unquantized but not in {} of quantization_config (vLLM would expect {module}.{primary})",
                    if mtp { " (MTP layer)" } else { "" },
                    format.skip_list_name()
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
    let per_layer = pruned_counts(&config, n_experts, &mut problems);
    for (module, by_id) in &experts {
        let layer_count =
            forge_io::split_layer_name(module).and_then(|(_, l)| per_layer.get(&l).copied());
        if let Some(count) = layer_count.or(n_experts) {
            if let Some((&bad, _)) = by_id.range(count..).next() {
                problems.push(format!("{module}.{bad}: expert id ≥ the configured expert count {count} (vLLM raises KeyError)"));
            }
            // Count without allocating per configured expert (the count comes from a file).
            let present = by_id.range(..count).count();
            if present < count {
                let first = (0..count)
                    .zip(
                        by_id
                            .range(..count)
                            .map(|(&e, _)| e)
                            .chain(std::iter::repeat(usize::MAX)),
                    )
                    .find(|(want, have)| want != have)
                    .map_or(0, |(w, _)| w);
                problems.push(format!(
                    "{module}: {} of {count} experts missing, e.g. {first} (vLLM would leave them uninitialised)",
                    count - present
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
    check_expected_layout(
        &ckpt,
        &config,
        &arch,
        format,
        n_layers,
        &mut problems,
        &mut counts,
    );
    check_finite_copies(&ckpt, &mut problems, &mut counts);
    for (kind, &c) in &counts {
        if c > MAX_LISTED {
            problems.push(format!(
                "... and {} more problem(s) of kind {kind:?}",
                c - MAX_LISTED
            ));
        }
    }
    r.problems = problems;
    Ok(r)
}

/// The experts of each remapped layer (per-layer counts of a `remap`
/// pruning block); checks the block itself (compact ids dense `0..k`, maps
/// of the original length, compact layout agreeing with the config count).
fn pruned_counts(
    config: &Value,
    n_experts: Option<usize>,
    problems: &mut Vec<String>,
) -> BTreeMap<usize, usize> {
    let mut out = BTreeMap::new();
    let Some(block) = config.get(crate::prune::CONFIG_KEY) else {
        return out;
    };
    let key = crate::prune::CONFIG_KEY;
    let layout = block.get("layout").and_then(Value::as_str).unwrap_or("");
    if !["compact", "remap"].contains(&layout) {
        problems.push(format!(
            "config.json {key}.layout is {}, expected \"compact\" or \"remap\"",
            shown(block, "layout")
        ));
        return out;
    }
    let e = block.get("num_original_experts").and_then(Value::as_u64);
    let Some(maps) = block.get("expert_map").and_then(Value::as_object) else {
        problems.push(format!(
            "config.json {key}.expert_map is missing or not an object"
        ));
        return out;
    };
    for (layer, m) in maps {
        let Ok(l) = layer.parse::<usize>() else {
            problems.push(format!(
                "config.json {key}.expert_map key {layer:?} is not a layer index"
            ));
            continue;
        };
        let ids: Option<Vec<i64>> = m
            .as_array()
            .and_then(|a| a.iter().map(Value::as_i64).collect());
        let Some(ids) = ids.filter(|v| e.is_some_and(|e| v.len() as u64 == e)) else {
            problems.push(format!(
                "config.json {key}.expert_map[{layer}] is not a list of num_original_experts ({}) integers",
                e.map_or("missing".into(), |e| e.to_string())
            ));
            continue;
        };
        let mut kept: Vec<i64> = ids.iter().copied().filter(|&x| x >= 0).collect();
        kept.sort_unstable();
        let k = kept.len();
        if kept != (0..k as i64).collect::<Vec<_>>() || ids.iter().any(|&x| x < -1) {
            problems.push(format!(
                "config.json {key}.expert_map[{layer}]: compact ids must be 0..{k} once each, the others -1"
            ));
        }
        // Compact ids follow the original order.
        let in_order: Vec<i64> = ids.iter().copied().filter(|&x| x >= 0).collect();
        if in_order.windows(2).any(|w| w[0] > w[1]) {
            problems.push(format!(
                "config.json {key}.expert_map[{layer}]: compact ids are not in the original expert order"
            ));
        }
        if layout == "compact" && n_experts.is_some_and(|n| n != k) {
            problems.push(format!(
                "config.json {key}.expert_map[{layer}] keeps {k} experts, but the config's expert count is {}",
                n_experts.unwrap_or(0)
            ));
        }
        if layout == "remap" {
            out.insert(l, k);
        }
    }
    out
}

/// `config` with the expert count of a remapped `layer` (its pruning block) in place
/// of the model's, for the expected layout of that layer.
fn config_for_layer(config: &Value, arch: &Architecture, layer: usize) -> Value {
    let k = config
        .get(crate::prune::CONFIG_KEY)
        .filter(|b| b.get("layout").and_then(Value::as_str) == Some("remap"))
        .and_then(|b| b.pointer(&format!("/expert_map/{layer}")))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter(|x| x.as_i64().is_some_and(|x| x >= 0))
                .count()
        });
    let Some(k) = k else {
        return config.clone();
    };
    let mut c = config.clone();
    for key in arch.expert_count_keys {
        for obj in [c.as_object_mut()].into_iter().flatten() {
            if obj.contains_key(*key) {
                obj.insert((*key).to_string(), json!(k));
            }
            if let Some(t) = obj.get_mut("text_config").and_then(Value::as_object_mut) {
                if t.contains_key(*key) {
                    t.insert((*key).to_string(), json!(k));
                }
            }
        }
    }
    c
}

/// Every layer and every linear `config.json` implies is present with the
/// implied shape (quantized `[K, N/8]` or unquantized `[N, K]`); embedding and
/// `lm_head` agree with `hidden_size` / `vocab_size`.
fn check_expected_layout(
    ckpt: &Checkpoint,
    config: &Value,
    arch: &Architecture,
    format: OutputFormat,
    n_layers: Option<usize>,
    problems: &mut Vec<String>,
    counts: &mut BTreeMap<&'static str, usize>,
) {
    let Some(n_layers) = n_layers else { return };
    let prefix = ckpt.layer_prefix().unwrap_or("model.").to_owned();
    let present: BTreeSet<usize> = ckpt.layers().into_iter().collect();
    for layer in 0..n_layers {
        if !present.contains(&layer) {
            push_capped(
                problems,
                counts,
                "missing layer",
                format!("{prefix}layers.{layer}: missing (config.json has num_hidden_layers = {n_layers}, the checkpoint has no tensor of this layer)"),
            );
            continue;
        }
        let layer_config = config_for_layer(config, arch, layer);
        let expected = match expected_linears(arch, &layer_config, layer) {
            Ok(Some(e)) => e,
            Ok(None) => return,
            Err(e) => {
                problems.push(e);
                return;
            }
        };
        for e in expected {
            let module = format!("{prefix}layers.{layer}.{}", e.module);
            let (n, k) = (e.n, e.k);
            let primary = format.primary();
            if let Some(qw) = ckpt.get(&format!("{module}.{primary}")) {
                let want = format
                    .specs(&module, n, k, 1, true)
                    .into_iter()
                    .next()
                    .map(|s| s.shape)
                    .unwrap_or_default();
                if qw.shape != want.as_slice() || !n.is_multiple_of(8) || !k.is_multiple_of(8) {
                    push_capped(problems, counts, "shape", format!(
                        "{module}.{primary} ({}): shape {:?}, but config.json implies {want:?} (in_features {k}, out_features {n})",
                        qw.file.display(), qw.shape
                    ));
                }
            } else if let Some(w) = ckpt.get(&format!("{module}.weight")) {
                if w.shape != [n, k] {
                    push_capped(
                        problems,
                        counts,
                        "shape",
                        format!(
                            "{module}.weight ({}): shape {:?}, but config.json implies [{n}, {k}]",
                            w.file.display(),
                            w.shape
                        ),
                    );
                }
            } else {
                push_capped(
                    problems,
                    counts,
                    "missing linear",
                    format!("{module}: missing (neither .{} nor .weight; config.json implies a [{n}, {k}] linear)", format.primary()),
                );
            }
        }
    }
    // Embedding and head against the config.
    let hidden = config_dim(config, "hidden_size").ok().flatten();
    let vocab = config_dim(config, "vocab_size").ok().flatten();
    for name in ckpt.non_layer_tensors() {
        if !(name.ends_with("embed_tokens.weight") || name == "lm_head.weight") {
            continue;
        }
        let Some(t) = ckpt.get(name) else { continue };
        let bad = match t.shape {
            [v, h] => hidden.is_some_and(|x| x != *h) || vocab.is_some_and(|x| x != *v),
            _ => true,
        };
        if bad {
            problems.push(format!(
                "{name} ({}): shape {:?} contradicts config.json (vocab_size {vocab:?}, hidden_size {hidden:?})",
                t.file.display(),
                t.shape
            ));
        }
    }
}

/// No NaN or infinity in the float tensors copied from the source (streamed
/// over the mmap in chunks; pages are released after each tensor).
fn check_finite_copies(
    ckpt: &Checkpoint,
    problems: &mut Vec<String>,
    counts: &mut BTreeMap<&'static str, usize>,
) {
    for t in ckpt.iter() {
        if t.name.ends_with(".scales") || t.name.ends_with(".weight_scale") {
            continue; // checked with the quantized linear
        }
        if let Some(i) = first_non_finite(t.dtype, t.bytes) {
            push_capped(
                problems,
                counts,
                "non-finite",
                format!(
                    "{} ({}): non-finite value at flat element {i} ({})",
                    t.name,
                    t.file.display(),
                    t.dtype
                ),
            );
        }
        ckpt.release([t.name]);
    }
}

/// `(module, suffix)` of a tensor of a quantized linear in any supported format.
fn quantized_part(name: &str) -> Option<(&str, &'static str)> {
    OutputFormat::ALL
        .iter()
        .flat_map(|f| f.all_suffixes().iter())
        .find_map(|s| {
            name.strip_suffix(s)
                .and_then(|m| m.strip_suffix('.'))
                .map(|m| (m, *s))
        })
}

fn shown(q: &Value, key: &str) -> String {
    q.get(key).map_or("missing".into(), Value::to_string)
}

fn check_group_size(v: Option<&Value>, what: &str, problems: &mut Vec<String>) -> usize {
    match v.and_then(Value::as_u64) {
        Some(x) => match usize::try_from(x)
            .map_err(|_| ())
            .and_then(|x| check_vllm_group_size(x).map(|()| x).map_err(|_| ()))
        {
            Ok(x) => x,
            Err(()) => {
                problems.push(format!(
                    "config.json {what} {x}: vLLM loads 4-bit checkpoints with 32, 64 or 128 only"
                ));
                0
            }
        },
        None => {
            problems.push(format!(
                "config.json {what} is {}, expected 32, 64 or 128",
                v.map_or("missing".into(), Value::to_string)
            ));
            0
        }
    }
}

fn string_list(v: Option<&Value>, what: &str, out: &mut Vec<String>, problems: &mut Vec<String>) {
    match v {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for v in a {
                match v.as_str() {
                    Some(s) => out.push(s.to_owned()),
                    None => problems.push(format!("{what} holds a non-string {v}")),
                }
            }
        }
        Some(v) => problems.push(format!("{what} is {v}, expected a list")),
    }
}

/// Checks the `quantization_config` block of `format`; returns the group size
/// (0 when unusable) and whether the grid is symmetric, and fills `skip` with
/// the modules it leaves unquantized.
fn check_quant_config(
    format: OutputFormat,
    q: &Value,
    skip: &mut Vec<String>,
    problems: &mut Vec<String>,
) -> (usize, bool) {
    let expect = |k: &str, v: Value, problems: &mut Vec<String>| {
        if q.get(k) != Some(&v) {
            problems.push(format!(
                "config.json quantization_config.{k} is {}, expected {v}",
                shown(q, k)
            ));
        }
    };
    match format {
        OutputFormat::Awq => {
            expect("bits", json!(4), problems);
            expect("zero_point", json!(true), problems);
            expect("version", json!("gemm"), problems);
            let g = check_group_size(
                q.get("group_size"),
                "quantization_config.group_size",
                problems,
            );
            string_list(
                q.get("modules_to_not_convert"),
                "modules_to_not_convert",
                skip,
                problems,
            );
            (g, false)
        }
        OutputFormat::Gptq => {
            expect("bits", json!(4), problems);
            expect("desc_act", json!(false), problems);
            expect("sym", json!(true), problems);
            expect("checkpoint_format", json!("gptq"), problems);
            let g = check_group_size(
                q.get("group_size"),
                "quantization_config.group_size",
                problems,
            );
            match q.get("dynamic") {
                None | Some(Value::Null) => {}
                Some(Value::Object(rules)) => {
                    for rule in rules.keys() {
                        match parse_gptq_skip_rule(rule) {
                            Some(m) => skip.push(m),
                            None => problems.push(format!(
                                "config.json quantization_config.dynamic rule {rule:?} is not a rule forge writes (\"-:<escaped module>(?:\\.|$)\"); cannot check what vLLM does with it"
                            )),
                        }
                    }
                }
                Some(v) => problems.push(format!(
                    "config.json quantization_config.dynamic is {v}, expected an object"
                )),
            }
            (g, true)
        }
        OutputFormat::CompressedTensors => {
            expect("format", json!("pack-quantized"), problems);
            let groups = q.get("config_groups").and_then(Value::as_object);
            let weights: Vec<&Value> = groups
                .map(|g| g.values().filter_map(|x| x.get("weights")).collect())
                .unwrap_or_default();
            let Some(w) = weights
                .first()
                .filter(|_| weights.len() == 1 && groups.is_some_and(|g| g.len() == 1))
            else {
                problems.push(format!(
                    "config.json quantization_config.config_groups is {}, expected one group with \"weights\"",
                    shown(q, "config_groups")
                ));
                return (0, true);
            };
            for (k, v) in [
                ("num_bits", json!(4)),
                ("type", json!("int")),
                ("strategy", json!("group")),
            ] {
                if w.get(k) != Some(&v) {
                    problems.push(format!(
                        "config.json config_groups weights.{k} is {}, expected {v}",
                        shown(w, k)
                    ));
                }
            }
            for k in ["actorder", "dynamic"] {
                if !matches!(
                    w.get(k),
                    None | Some(Value::Null) | Some(Value::Bool(false))
                ) {
                    problems.push(format!(
                        "config.json config_groups weights.{k} is {}, expected null or false",
                        shown(w, k)
                    ));
                }
            }
            let symmetric = match w.get("symmetric") {
                Some(Value::Bool(b)) => *b,
                v => {
                    problems.push(format!(
                        "config.json config_groups weights.symmetric is {}, expected true or false",
                        v.map_or("missing".into(), Value::to_string)
                    ));
                    true
                }
            };
            let g = check_group_size(
                w.get("group_size"),
                "config_groups weights.group_size",
                problems,
            );
            let mut ignore = Vec::new();
            string_list(
                q.get("ignore"),
                "quantization_config.ignore",
                &mut ignore,
                problems,
            );
            for e in ignore {
                if e.starts_with("re:") {
                    problems.push(format!(
                        "config.json quantization_config.ignore entry {e:?} is a regular expression; forge writes (and checks) full module names only"
                    ));
                } else {
                    skip.push(e);
                }
            }
            (g, symmetric)
        }
    }
}

fn le_i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .collect()
}

/// The tensors of quantized linear `m` against what `format` writes: every
/// one present with its dtype and shape, nothing extra, positive finite
/// scales, `g_idx = k // G` (GPTQ) and `weight_shape = [N, K]` (compressed-tensors).
fn check_quantized_linear(
    ckpt: &Checkpoint,
    format: OutputFormat,
    m: &str,
    g: usize,
    symmetric: bool,
    problems: &mut Vec<String>,
) {
    let get = |s: &str| ckpt.get(&format!("{m}.{s}"));
    let primary = format.primary();
    if get("weight").is_some() {
        problems.push(format!("{m}: both .weight and .{primary}"));
    }
    let Some(p) = get(primary) else { return };
    let Some(shape) = format.shape_from_primary(p.shape) else {
        problems.push(format!(
            "{m}.{primary} ({}): shape {:?}, expected rank 2 ({})",
            p.file.display(),
            p.shape,
            format.name()
        ));
        return;
    };
    let (n, k) = (shape.n, shape.k);
    if g == 0 {
        return;
    }
    if !k.is_multiple_of(g) || n == 0 || k == 0 {
        problems.push(format!(
            "{m}.{primary} ({}): in_features {k} is not a positive multiple of group size {g}",
            p.file.display()
        ));
        return;
    }
    let specs = format.specs(m, n, k, g, symmetric);
    for s in &specs {
        let suffix = &s.name[m.len() + 1..];
        let Some(t) = ckpt.get(&s.name) else {
            problems.push(format!(
                "{m}: no {} (format {} writes {}, {:?} with {primary} {:?})",
                s.name,
                format.name(),
                s.dtype,
                s.shape,
                p.shape
            ));
            continue;
        };
        let dtype_ok = t.dtype == s.dtype
            || (format == OutputFormat::CompressedTensors
                && suffix == "weight_scale"
                && t.dtype == Dtype::BF16);
        if !dtype_ok || t.shape != s.shape.as_slice() {
            problems.push(format!(
                "{} ({}): {} {:?}, expected {} {:?}",
                s.name,
                t.file.display(),
                t.dtype,
                t.shape,
                s.dtype,
                s.shape
            ));
            continue;
        }
        match suffix {
            "scales" | "weight_scale" => {
                let bad = t.bytes.chunks_exact(2).position(|b| {
                    let v = if t.dtype == Dtype::BF16 {
                        half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
                    } else {
                        f16::from_le_bytes([b[0], b[1]]).to_f32()
                    };
                    !(v > 0.0 && v.is_finite())
                });
                if let Some(i) = bad {
                    problems.push(format!(
                        "{} ({}): element {i} is not a positive finite {} number",
                        s.name,
                        t.file.display(),
                        t.dtype
                    ));
                }
            }
            "g_idx" => {
                let bad = t.bytes.chunks_exact(4).enumerate().find(|(i, b)| {
                    i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64 != (i / g) as i64
                });
                if let Some((i, _)) = bad {
                    problems.push(format!(
                        "{} ({}): element {i} is not {i} // {g} (act-order / desc_act is not written by forge and vLLM needs desc_act false)",
                        s.name,
                        t.file.display()
                    ));
                }
            }
            "weight_shape" => {
                let v = le_i64s(t.bytes);
                if v != [n as i64, k as i64] {
                    problems.push(format!(
                        "{} ({}): holds {v:?}, but {primary} {:?} implies [{n}, {k}]",
                        s.name,
                        t.file.display(),
                        p.shape
                    ));
                }
            }
            _ => {}
        }
    }
    for suffix in format.all_suffixes() {
        let name = format!("{m}.{suffix}");
        if ckpt.get(&name).is_some() && !specs.iter().any(|s| s.name == name) {
            problems.push(format!(
                "{name}: not part of format {} with symmetric = {symmetric} (vLLM raises KeyError on it)",
                format.name()
            ));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn group_sizes_vllm_loads() {
        for g in [32, 64, 128] {
            assert!(check_vllm_group_size(g).is_ok());
        }
        for g in [0, 16, 96, 256, 1024] {
            let e = check_vllm_group_size(g).unwrap_err().to_string();
            assert!(e.contains("32, 64 or 128"), "{e}");
        }
        let opts = QuantOptions {
            group_size: 256,
            ..Default::default()
        };
        assert!(check_quant_options(&opts).is_err());
        assert!(check_quant_options(&QuantOptions::default()).is_ok());
    }

    #[test]
    fn non_finite_scan() {
        let f32s: Vec<u8> = [1.0f32, -2.0, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(Dtype::F32, &f32s), Some(2));
        assert_eq!(first_non_finite(Dtype::F32, &f32s[..8]), None);
        let bf: Vec<u8> = [0x3F80u16, 0xFF80, 0x7FC0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(Dtype::BF16, &bf), Some(1));
        let h: Vec<u8> = [0x3C00u16, 0x7BFF, 0x7C00]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(Dtype::F16, &h), Some(2));
        assert_eq!(first_non_finite(Dtype::I32, &f32s), None);
        // past the first chunk
        let mut big = vec![0u8; (1 << 20) + 64];
        big[(1 << 20) + 8..(1 << 20) + 12].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert_eq!(first_non_finite(Dtype::F32, &big), Some((1 << 18) + 2));
    }

    #[test]
    fn json_reader_refuses_pipes_and_huge_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        assert!(read_json_file(&p, 100).unwrap().is_none());
        std::fs::write(&p, "{\"a\": 1}").unwrap();
        assert_eq!(read_json_file(&p, 100).unwrap(), Some(json!({"a": 1})));
        assert!(read_json_file(&p, 4).is_err());
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        let e = read_json_file(&p, 100).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
