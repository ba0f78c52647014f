//! Helpers shared by the integration tests: hand-made safetensors bytes.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

/// Length prefix + `header` + `data`, with no validation at all.
pub fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A well-formed file holding `(name, dtype, shape, bytes)` back to back.
pub fn shard(tensors: &[(&str, &str, &[usize], &[u8])]) -> Vec<u8> {
    let (mut entries, mut data) = (Vec::new(), Vec::new());
    for (name, dtype, shape, bytes) in tensors {
        let (b, e) = (data.len(), data.len() + bytes.len());
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{b},{e}]}}"#
        ));
        data.extend_from_slice(bytes);
    }
    raw(&format!("{{{}}}", entries.join(",")), &data)
}

pub fn put(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens a one-file checkpoint made of `bytes`.
pub fn open_bytes(bytes: &[u8]) -> (tempfile::TempDir, forge_io::Result<forge_io::Checkpoint>) {
    let dir = tempfile::tempdir().unwrap();
    put(dir.path(), "model.safetensors", bytes);
    let ck = forge_io::Checkpoint::open(dir.path());
    (dir, ck)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `model.safetensors.index.json` with the given `(tensor, file)` map.
pub fn index(dir: &Path, map: &[(&str, &str)]) -> PathBuf {
    let wm: serde_json::Map<String, serde_json::Value> = map
        .iter()
        .map(|(t, f)| (t.to_string(), serde_json::json!(f)))
        .collect();
    let text = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": wm}).to_string();
    put(dir, "model.safetensors.index.json", text.as_bytes())
}
