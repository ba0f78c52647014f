//! `inspect`: what a checkpoint folder holds (layers, experts, dtypes, sizes,
//! quantization status), read from the headers only.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use forge_io::Checkpoint;
use serde_json::{json, Value};

use crate::arch::{num_hidden_layers, Architecture};
use crate::plan::{self, QuantOptions};
use crate::Result;

/// Inspects `dir`; the JSON holds everything [`render`] prints.
pub fn inspect(dir: &Path) -> Result<Value> {
    let ckpt = Checkpoint::open(dir)?;
    let config = plan::read_config(dir)?;
    let arch = Architecture::detect(&config);
    let n_layers = num_hidden_layers(&config);
    let layers = ckpt.layers();
    let mtp: Vec<usize> = layers
        .iter()
        .copied()
        .filter(|&l| arch.has_mtp && n_layers.is_some_and(|n| l >= n))
        .collect();

    let mut dtypes: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in ckpt.iter() {
        let e = dtypes.entry(t.dtype.name().to_owned()).or_default();
        e.0 += 1;
        e.1 += t.bytes.len() as u64;
    }
    // Experts per layer, and linear status per layer.
    let mut experts_per_layer: BTreeMap<usize, usize> = BTreeMap::new();
    let (mut quantized, mut linears, mut fp8_linears, mut layer_bytes_max) =
        (0usize, 0usize, 0usize, 0u64);
    for &l in &layers {
        let mut ids = std::collections::BTreeSet::new();
        let mut bytes = 0u64;
        for name in ckpt.layer_tensors(l) {
            let Some(t) = ckpt.get(name) else { continue };
            bytes += t.bytes.len() as u64;
            if let Some((_, e)) = arch.expert_of(name) {
                ids.insert(e);
            }
            if name.ends_with(".qweight") || name.ends_with(".weight_packed") {
                quantized += 1;
            } else if arch.is_linear(name, t.shape) {
                linears += 1;
                if t.dtype == forge_io::Dtype::F8_E4M3 {
                    fp8_linears += 1;
                }
            }
        }
        layer_bytes_max = layer_bytes_max.max(bytes);
        if !ids.is_empty() {
            experts_per_layer.insert(l, ids.len());
        }
    }
    let quant_cfg = config
        .get("quantization_config")
        .cloned()
        .unwrap_or(Value::Null);
    let status = if quantized > 0 {
        format!(
            "quantized ({}): {quantized} packed linears, {linears} unquantized linears",
            quant_cfg
                .get("quant_method")
                .and_then(Value::as_str)
                .unwrap_or("unknown method")
        )
    } else if fp8_linears > 0 {
        format!("FP8 source: {fp8_linears} of {linears} linears in F8_E4M3 with block scales")
    } else {
        format!("unquantized: {linears} linears")
    };
    // What a default run would do (no data read).
    let default_plan = if quantized == 0 {
        let opts = QuantOptions {
            skip_unpackable: true,
            ..QuantOptions::default()
        };
        match plan::build(&ckpt, &config, &opts) {
            Ok(p) => json!({
                "group_size": opts.group_size,
                "would_quantize": p.n_quantized(),
                "modules_to_not_convert": p.not_convert.len(),
                "output_bytes": p.specs.iter().map(|s| s.shape.iter().product::<usize>() as u64 * s.dtype.size() as u64).sum::<u64>(),
                "notes": p.notes,
            }),
            Err(e) => json!({"error": e.to_string()}),
        }
    } else {
        Value::Null
    };
    Ok(json!({
        "path": dir.display().to_string(),
        "model_type": config.get("model_type").cloned().unwrap_or(Value::Null),
        "family": arch.name,
        "shards": ckpt.files().count(),
        "tensors": ckpt.len(),
        "total_bytes": ckpt.total_bytes(),
        "layer_prefix": ckpt.layer_prefix(),
        "num_hidden_layers": n_layers,
        "layers": layers.len(),
        "mtp_layers": mtp,
        "largest_layer_bytes": layer_bytes_max,
        "experts_config": arch.expert_count(&config),
        "experts_per_layer": experts_per_layer.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "dtypes": dtypes.iter().map(|(k, (n, b))| (k.clone(), json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
        "quantization_config": quant_cfg,
        "status": status,
        "default_plan": default_plan,
    }))
}

/// Human-readable size (`1.50 GB`, decimal units).
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1000.0 && i + 1 < units.len() {
        v /= 1000.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[i])
    }
}

/// Renders [`inspect`]'s JSON as a short text report.
pub fn render(v: &Value) -> String {
    let mut s = String::new();
    let g = |k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    let u = |k: &str| g(k).as_u64().unwrap_or(0);
    let _ = writeln!(s, "{}", g("path").as_str().unwrap_or(""));
    let _ = writeln!(
        s,
        "  family      {} (model_type {})",
        g("family").as_str().unwrap_or("?"),
        g("model_type")
    );
    let _ = writeln!(
        s,
        "  tensors     {} in {} shard(s), {}",
        u("tensors"),
        u("shards"),
        human_bytes(u("total_bytes"))
    );
    let mtp = g("mtp_layers");
    let _ = writeln!(
        s,
        "  layers      {} (num_hidden_layers {}, MTP {}), largest {}",
        u("layers"),
        g("num_hidden_layers"),
        mtp,
        human_bytes(u("largest_layer_bytes"))
    );
    if let Some(e) = g("experts_per_layer").as_object().filter(|m| !m.is_empty()) {
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for c in e.values() {
            *counts.entry(c.as_u64().unwrap_or(0)).or_default() += 1;
        }
        let desc: Vec<String> = counts
            .iter()
            .map(|(c, n)| format!("{n} layer(s) × {c} experts"))
            .collect();
        let _ = writeln!(
            s,
            "  experts     {} (config: {})",
            desc.join(", "),
            g("experts_config")
        );
    }
    if let Some(d) = g("dtypes").as_object() {
        let desc: Vec<String> = d
            .iter()
            .map(|(k, x)| {
                format!(
                    "{k} {} ({})",
                    x["tensors"].as_u64().unwrap_or(0),
                    human_bytes(x["bytes"].as_u64().unwrap_or(0))
                )
            })
            .collect();
        let _ = writeln!(s, "  dtypes      {}", desc.join(", "));
    }
    let _ = writeln!(s, "  status      {}", g("status").as_str().unwrap_or(""));
    let p = g("default_plan");
    if let Some(n) = p.get("would_quantize") {
        let _ = writeln!(
            s,
            "  default run group 128: quantizes {n} linears, keeps {} modules unquantized, writes {}",
            p["modules_to_not_convert"],
            human_bytes(p["output_bytes"].as_u64().unwrap_or(0))
        );
        for note in p["notes"].as_array().into_iter().flatten() {
            let _ = writeln!(s, "    note: {}", note.as_str().unwrap_or(""));
        }
    } else if let Some(e) = p.get("error") {
        let _ = writeln!(s, "  default run: {}", e.as_str().unwrap_or(""));
    }
    s
}
