//! `verify`: checks that an output directory is a complete, consistent AWQ
//! checkpoint that stock vLLM loads (facts: shared/notes/formats.md).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use forge_io::{Checkpoint, Dtype, INDEX_FILE, PARTIAL_SUFFIX};
use half::f16;
use serde_json::{json, Value};

use crate::arch::{config_dim, expected_linears, num_hidden_layers, Architecture, MAX_CONFIG_DIM};
use crate::plan::QuantOptions;
use crate::run::MANIFEST_FILE;
use crate::{Error, Result};

/// Group sizes vLLM loads AWQ checkpoints with (its Marlin / AWQ kernels).
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
            format!("{group_size}: vLLM loads AWQ checkpoints with group size 32, 64 or 128 only"),
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
            Some(x) => match usize::try_from(x).map_err(|_| ()).and_then(|x| {
                check_vllm_group_size(x).map(|()| x).map_err(|_| ())
            }) {
                Ok(x) => g = x,
                Err(()) => problems.push(format!(
                    "config.json quantization_config.group_size {x}: vLLM loads AWQ with 32, 64 or 128 only"
                )),
            },
            None => problems.push(format!(
                "config.json quantization_config.group_size is {}, expected 32, 64 or 128",
                q.get("group_size").map_or("missing".into(), Value::to_string)
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
                "{m}.qweight ({}): shape {:?}, expected [K, N/8] (rank 2)",
                qw.file.display(),
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
                "{m}.scales ({}): element {i} (group {}, column {}) is not a positive finite fp16 number",
                sc.file.display(),
                i / n.max(1),
                i % n.max(1)
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
    check_expected_layout(&ckpt, &config, &arch, n_layers, &mut problems, &mut counts);
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

/// Every layer and every linear `config.json` implies is present with the
/// implied shape (quantized `[K, N/8]` or unquantized `[N, K]`); embedding and
/// `lm_head` agree with `hidden_size` / `vocab_size`.
fn check_expected_layout(
    ckpt: &Checkpoint,
    config: &Value,
    arch: &Architecture,
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
        let expected = match expected_linears(arch, config, layer) {
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
            if let Some(qw) = ckpt.get(&format!("{module}.qweight")) {
                if qw.shape != [k, n / 8] || !n.is_multiple_of(8) {
                    push_capped(problems, counts, "shape", format!(
                        "{module}.qweight ({}): shape {:?}, but config.json implies [{k}, {}] (in_features {k}, out_features {n})",
                        qw.file.display(), qw.shape, n / 8
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
                    format!("{module}: missing (neither .qweight nor .weight; config.json implies a [{n}, {k}] linear)"),
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
        if t.name.ends_with(".scales") {
            continue; // checked with the quantized triple
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
