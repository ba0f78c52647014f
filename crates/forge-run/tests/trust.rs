//! Issue 10 ("trust the output"): bad inputs found at plan time before any
//! byte is written, the free space check, and `--overwrite` that removes only
//! what forge writes.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use forge_io::Dtype;
use forge_run::{Error, NoProgress, Options};
use serde_json::json;

/// A one-layer Llama-like checkpoint, hidden 64, with `tweak` applied to the
/// tensor list; every byte is `fill` (1.0 in E4M3 for FP8 weights).
fn checkpoint(dir: &Path, tweak: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>)>)) -> PathBuf {
    let h = 64usize;
    let mut t: Vec<(String, Dtype, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), Dtype::BF16, vec![96, h]),
        ("model.norm.weight".into(), Dtype::BF16, vec![h]),
    ];
    for (n, s) in [
        ("self_attn.q_proj.weight", vec![h, h]),
        ("self_attn.o_proj.weight", vec![h, h]),
        ("mlp.up_proj.weight", vec![128, h]),
        ("mlp.gate_proj.weight", vec![128, h]),
        ("mlp.down_proj.weight", vec![h, 128]),
        ("input_layernorm.weight", vec![h]),
    ] {
        t.push((format!("model.layers.0.{n}"), Dtype::BF16, s));
    }
    tweak(&mut t);
    common::write_checkpoint(dir, &t, 1 << 30, |_, _, d, n| {
        vec![if d == Dtype::F8_E4M3 { 0x38 } else { 0x3c }; n * d.size()]
    });
    let cfg = json!({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": h});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    dir.into()
}

fn opts() -> Options {
    Options {
        group_size: 32,
        ..Options::default()
    }
}

fn set(t: &mut [(String, Dtype, Vec<usize>)], name: &str, d: Dtype, shape: Vec<usize>) {
    let e = t.iter_mut().find(|e| e.0.ends_with(name)).unwrap();
    e.1 = d;
    e.2 = shape;
}

/// Runs into `tmp/out` and returns the message, checking no output folder was made.
fn plan_error(tmp: &Path, src: &Path) -> String {
    let out = tmp.join("out");
    let e = forge_run::quantize(src, &out, &opts(), &NoProgress).unwrap_err();
    assert!(
        !out.exists(),
        "nothing may be written before the plan is valid: {e}"
    );
    e.to_string()
}

#[test]
fn integer_linear_selected_for_quantization_fails_at_plan_time() {
    let tmp = tempfile::tempdir().unwrap();
    let src = checkpoint(&tmp.path().join("src"), |t| {
        set(t, "mlp.down_proj.weight", Dtype::I8, vec![64, 128]);
    });
    let msg = plan_error(tmp.path(), &src);
    assert!(
        msg.contains("model.layers.0.mlp.down_proj.weight")
            && msg.contains("I8")
            && msg.contains("model-00001-of-00001.safetensors")
            && msg.contains("--exclude down_proj"),
        "{msg}"
    );
    // Excluded, it is copied as is.
    let mut o = opts();
    o.exclude = vec!["down_proj".into()];
    forge_run::quantize(&src, &tmp.path().join("ok"), &o, &NoProgress).unwrap();
}

#[test]
fn fp8_weight_without_scale_fails_at_plan_time() {
    let tmp = tempfile::tempdir().unwrap();
    let src = checkpoint(&tmp.path().join("src"), |t| {
        set(t, "self_attn.o_proj.weight", Dtype::F8_E4M3, vec![64, 64]);
    });
    let msg = plan_error(tmp.path(), &src);
    assert!(
        msg.contains("model.layers.0.self_attn.o_proj.weight_scale_inv")
            && msg.contains("model-00001-of-00001.safetensors"),
        "{msg}"
    );
}

#[test]
fn fp8_weight_with_misshaped_scale_fails_at_plan_time() {
    // [200, 64] needs a [ceil(200/128), ceil(64/128)] = [2, 1] scale.
    for (bad, shown) in [(vec![1usize, 1], "[1, 1]"), (vec![2, 1, 1], "[2, 1, 1]")] {
        let tmp = tempfile::tempdir().unwrap();
        let src = checkpoint(&tmp.path().join("src"), |t| {
            set(t, "mlp.up_proj.weight", Dtype::F8_E4M3, vec![200, 64]);
            t.push((
                "model.layers.0.mlp.up_proj.weight_scale_inv".into(),
                Dtype::F32,
                bad,
            ));
        });
        let msg = plan_error(tmp.path(), &src);
        assert!(
            msg.contains("model.layers.0.mlp.up_proj.weight_scale_inv")
                && msg.contains("[2, 1]")
                && msg.contains(shown),
            "{msg}"
        );
    }
    // The right shape passes the plan (the weight is left unquantized: 200 is no multiple of 8).
    let tmp = tempfile::tempdir().unwrap();
    let src = checkpoint(&tmp.path().join("src"), |t| {
        set(t, "mlp.up_proj.weight", Dtype::F8_E4M3, vec![200, 64]);
        t.push((
            "model.layers.0.mlp.up_proj.weight_scale_inv".into(),
            Dtype::F32,
            vec![2, 1],
        ));
    });
    let mut o = opts();
    o.skip_unpackable = true;
    forge_run::quantize(&src, &tmp.path().join("ok"), &o, &NoProgress).unwrap();
}

#[test]
fn not_enough_free_space_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    // A sparse 2 TiB source tensor: the plan needs more than any test disk has.
    let rows = 1usize << 20;
    let header = format!(
        r#"{{"model.embed_tokens.weight":{{"dtype":"BF16","shape":[{rows},{rows}],"data_offsets":[0,{}]}}}}"#,
        2 * rows * rows
    );
    let mut h = header.into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    let path = src.join("model.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(bytes.len() as u64 + 2 * (rows * rows) as u64)
        .unwrap();
    let out = tmp.path().join("out");
    let e = forge_run::quantize(&src, &out, &opts(), &NoProgress).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::OutDir { .. }), "{msg}");
    let needed = 2u64 << 40;
    let shown: u64 = msg
        .split("needs ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    assert!(shown >= needed && shown < needed + 4096, "{msg}");
    assert!(
        msg.contains(&out.display().to_string())
            && msg.contains("available")
            && msg.contains("FORGE_DISK_CHECK=0"),
        "{msg}"
    );
    let shards: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("safetensors"))
        .collect();
    assert!(shards.is_empty(), "{shards:?}");
}

#[test]
fn overwrite_removes_only_what_forge_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = checkpoint(&tmp.path().join("src"), |_| {});
    let out = tmp.path().join("out");
    forge_run::quantize(&src, &out, &opts(), &NoProgress).unwrap();
    // Leftovers of an earlier run of any shape are forge's own.
    for f in [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00002.safetensors.partial",
        "forge-manifest.json",
    ] {
        std::fs::write(out.join(f), "old").unwrap();
    }
    std::fs::create_dir_all(out.join("forge-state/activations")).unwrap();
    std::fs::create_dir_all(out.join("forge")).unwrap();
    std::fs::write(out.join("forge/report.json"), "{}").unwrap();
    let mut o = opts();
    o.overwrite = true;
    // A user's files stop the run, and nothing is removed.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::create_dir_all(out.join("eval")).unwrap();
    std::fs::write(out.join("model.safetensors"), "mine too").unwrap();
    let before = names(&out);
    let msg = forge_run::quantize(&src, &out, &o, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("notes.txt") && msg.contains("eval/") && msg.contains("model.safetensors,"),
        "{msg}"
    );
    assert!(msg.contains("3 other(s)"), "{msg}");
    assert_eq!(names(&out), before);
    for f in ["notes.txt", "model.safetensors"] {
        std::fs::remove_file(out.join(f)).unwrap();
    }
    std::fs::remove_dir(out.join("eval")).unwrap();
    forge_run::quantize(&src, &out, &o, &NoProgress).unwrap();
    let after = names(&out);
    assert_eq!(
        after,
        [
            "config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json"
        ]
    );
    forge_run::verify::verify(&out).unwrap();
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "forge.lock")
        .collect();
    v.sort();
    v
}
