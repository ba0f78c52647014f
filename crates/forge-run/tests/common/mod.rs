//! Helpers shared by the forge-run integration tests: deterministic tensor bytes, small
//! checkpoints written with forge-io's own shard writer, and a folder snapshot.

#![allow(dead_code)] // each test crate uses a subset

use std::collections::BTreeMap;
use std::path::Path;

use forge_io::{Dtype, ShardPlan, ShardWriter, TensorSpec};
use half::bf16;

/// A deterministic pseudo-random value in [-0.1, 0.1).
pub fn val(seed: u64, i: usize) -> f32 {
    let mut x =
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
}

/// `n` values of [`val`] as little-endian bytes of `d` (f32, else bf16).
pub fn random_bytes(d: Dtype, n: usize, seed: u64) -> Vec<u8> {
    match d {
        Dtype::F32 => (0..n).flat_map(|i| val(seed, i).to_le_bytes()).collect(),
        _ => (0..n)
            .flat_map(|i| bf16::from_f32(val(seed, i)).to_le_bytes())
            .collect(),
    }
}

/// Writes `tensors` (name, dtype, shape) as a sharded safetensors checkpoint in `dir`;
/// `fill(k, name, dtype, numel)` gives the bytes of the `k`-th tensor.
pub fn write_checkpoint(
    dir: &Path,
    tensors: &[(String, Dtype, Vec<usize>)],
    max_shard_bytes: u64,
    fill: impl Fn(usize, &str, Dtype, usize) -> Vec<u8>,
) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s)| TensorSpec::new(n.clone(), *d, s.clone()))
        .collect();
    let plan = ShardPlan::new(specs, max_shard_bytes).unwrap();
    let w = ShardWriter::create(dir, plan, &BTreeMap::new()).unwrap();
    for (k, (n, d, s)) in tensors.iter().enumerate() {
        w.write_tensor(n, &fill(k, n, *d, s.iter().product()))
            .unwrap();
    }
    w.finish().unwrap();
}

/// Every file of `dir` (not recursive) by name, the run's lock file left out.
pub fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().unwrap() != "forge.lock")
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}
