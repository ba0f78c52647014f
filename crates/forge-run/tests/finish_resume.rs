//! A run killed while publishing (between shard renames) resumes to the same
//! bytes as an uninterrupted run. One test per binary: it sets a process-wide
//! test hook variable.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use forge_io::Dtype;
use forge_run::{Error, NoProgress, Options};
use serde_json::json;

fn llama(dir: &Path, layers: usize) {
    let h = 64usize;
    let mut t: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![96, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![96, h]),
    ];
    for l in 0..layers {
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.up_proj.weight", vec![128, h]),
            ("mlp.gate_proj.weight", vec![128, h]),
            ("mlp.down_proj.weight", vec![h, 128]),
            ("input_layernorm.weight", vec![h]),
        ] {
            t.push((format!("model.layers.{l}.{n}"), s));
        }
    }
    let t: Vec<(String, Dtype, Vec<usize>)> =
        t.into_iter().map(|(n, s)| (n, Dtype::BF16, s)).collect();
    common::write_checkpoint(dir, &t, 1 << 30, |k, _, _, n| {
        (0..n)
            .flat_map(|i| {
                let x = ((i * 7919 + k * 104_729) % 2001) as f32 / 1000.0 - 1.0;
                half::bf16::from_f32(x * 0.1).to_le_bytes()
            })
            .collect()
    });
    let cfg = json!({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": h});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
}

#[test]
fn kill_between_shard_renames_resumes_byte_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    llama(&src, 4);
    let o = Options {
        group_size: 32,
        max_shard_size: forge_run::options::Size::Bytes(15_000),
        ..Options::default()
    };
    let clean = tmp.path().join("clean");
    let rep = forge_run::quantize(&src, &clean, &o, &NoProgress).unwrap();
    assert!(rep.shards >= 4, "{} shards", rep.shards);
    let want = common::files(&clean);

    let out = tmp.path().join("out");
    std::env::set_var(forge_run::run::ABORT_RENAMES_ENV, "2");
    let e = forge_run::quantize(&src, &out, &o, &NoProgress).unwrap_err();
    assert!(matches!(e, Error::TestAbortFinish { renamed: 2 }), "{e}");
    let got = common::files(&out);
    let renamed: Vec<&String> = got.keys().filter(|n| n.ends_with(".safetensors")).collect();
    assert_eq!(renamed.len(), 2, "{:?}", got.keys());
    assert!(!got.contains_key("config.json") && !got.contains_key(forge_io::INDEX_FILE));
    let manifest: serde_json::Value =
        serde_json::from_slice(&got[forge_run::run::MANIFEST_FILE]).unwrap();
    let shard = |i: usize| format!("model-{i:05}-of-{:05}.safetensors", rep.shards);
    assert_eq!(
        manifest["finishing"]["renamed"],
        json!([shard(1), shard(2)]),
        "{manifest}"
    );
    assert!(forge_run::verify::verify(&out).is_err());

    // Without --resume the half-published folder is refused, not taken for finished.
    let e = forge_run::quantize(&src, &out, &o, &NoProgress).unwrap_err();
    assert!(e.to_string().contains("--resume"), "{e}");

    // Interrupted again, after one more rename: the first two are accepted in place.
    let mut r = o.clone();
    r.resume = true;
    std::env::set_var(forge_run::run::ABORT_RENAMES_ENV, "1");
    let e = forge_run::quantize(&src, &out, &r, &NoProgress).unwrap_err();
    assert!(matches!(e, Error::TestAbortFinish { renamed: 1 }), "{e}");
    std::env::remove_var(forge_run::run::ABORT_RENAMES_ENV);
    let rep2 = forge_run::quantize(&src, &out, &r, &NoProgress).unwrap();
    assert_eq!(rep2.resumed_units, rep2.units);
    assert_eq!(common::files(&out), want);
    forge_run::verify::verify(&out).unwrap();

    // A renamed shard that does not match the plan is not accepted: its units are redone.
    let out2 = tmp.path().join("out2");
    std::env::set_var(forge_run::run::ABORT_RENAMES_ENV, "2");
    forge_run::quantize(&src, &out2, &o, &NoProgress).unwrap_err();
    std::env::remove_var(forge_run::run::ABORT_RENAMES_ENV);
    let first = out2.join(shard(1));
    let len = std::fs::metadata(&first).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let rep3 = forge_run::quantize(&src, &out2, &r, &NoProgress).unwrap();
    assert!(rep3.resumed_units < rep3.units, "{}", rep3.resumed_units);
    assert_eq!(common::files(&out2), want);
}
