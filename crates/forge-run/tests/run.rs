//! Integration tests of the orchestrator on synthetic checkpoints written with forge-io:
//! output verifies, dequantizes back within half a step, is independent of the thread count,
//! resumes byte-identically after an interruption, and refuses bad setups with clear errors.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;

use forge_io::{Checkpoint, Dtype};
use forge_run::run::Progress;
use forge_run::{Error, NoProgress, Options};
use serde_json::json;

fn llama(dir: &Path, layers: usize) -> PathBuf {
    let (h, i, v) = (64usize, 128usize, 96usize);
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![32, h]),
            ("self_attn.v_proj.weight", vec![32, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            tensors.push((format!("{p}{n}"), s));
        }
    }
    let t: Vec<(String, Dtype, Vec<usize>)> = tensors
        .into_iter()
        .map(|(n, s)| (n, Dtype::BF16, s))
        .collect();
    common::write_checkpoint(dir, &t, 60_000, |k, _, d, n| {
        common::random_bytes(d, n, k as u64)
    });
    let cfg = json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "hidden_size": h});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    dir.into()
}

fn opts(g: usize) -> Options {
    Options {
        group_size: g,
        max_shard_size: forge_run::options::Size::Bytes(50_000),
        ..Options::default()
    }
}

#[test]
fn quantizes_verifies_and_dequantizes_within_half_a_step() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 2);
    let out = tmp.path().join("out");
    let rep = forge_run::quantize(&src, &out, &opts(32), &NoProgress).unwrap();
    assert_eq!(rep.quantized, 14);
    assert!(rep.shards >= 2);
    assert!(rep.not_convert.is_empty());
    let v = forge_run::verify::verify(&out).unwrap();
    assert_eq!(v.quantized, 14);
    let a = Checkpoint::open(&src).unwrap();
    let b = Checkpoint::open(&out).unwrap();
    for l in 0..2 {
        let m = format!("model.layers.{l}.mlp.down_proj");
        let w = a.dequantized_f32(&format!("{m}.weight")).unwrap();
        let qw: Vec<i32> = b
            .tensor(&format!("{m}.qweight"))
            .unwrap()
            .bytes
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let qz: Vec<i32> = b
            .tensor(&format!("{m}.qzeros"))
            .unwrap()
            .bytes
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let sc: Vec<half::f16> = b
            .tensor(&format!("{m}.scales"))
            .unwrap()
            .bytes
            .chunks(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let (k, n) = (128, 64);
        let d = forge_core::matmul::dequantize_awq(&qw, &qz, &sc, k, n, 32).unwrap();
        for r in 0..n {
            for c in 0..k {
                let s = sc[(c / 32) * n + r].to_f32();
                let e = (d[r * k + c] - w[r * k + c]).abs();
                assert!(e <= 0.53 * s, "{m}[{r},{c}]: error {e} vs step {s}");
            }
        }
    }
    // Untouched tensors are byte-identical; side files are copied; no leftovers.
    assert_eq!(
        a.tensor("lm_head.weight").unwrap().bytes,
        b.tensor("lm_head.weight").unwrap().bytes
    );
    assert!(out.join("tokenizer.json").is_file());
    assert!(!out.join(forge_run::run::MANIFEST_FILE).exists());
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "awq");
    assert_eq!(cfg["quantization_config"]["group_size"], 32);
}

#[test]
fn output_does_not_depend_on_threads_or_grid_mode_is_applied() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 2);
    let mut o1 = opts(32);
    o1.threads = Some(1);
    let mut o2 = opts(32);
    o2.threads = Some(2);
    forge_run::quantize(&src, &tmp.path().join("a"), &o1, &NoProgress).unwrap();
    forge_run::quantize(&src, &tmp.path().join("b"), &o2, &NoProgress).unwrap();
    assert_eq!(
        common::files(&tmp.path().join("a")),
        common::files(&tmp.path().join("b"))
    );
    let mut o3 = opts(32);
    o3.grid = forge_run::options::Grid::Mse;
    let rep = forge_run::quantize(&src, &tmp.path().join("c"), &o3, &NoProgress).unwrap();
    assert_eq!(rep.quantizer, "rtn-mse");
    assert_ne!(
        common::files(&tmp.path().join("a")),
        common::files(&tmp.path().join("c"))
    );
}

/// Stops the run after `n` units, as a kill would.
struct StopAfter(usize, AtomicUsize);
impl Progress for StopAfter {
    fn unit_done(&self, _label: &str, _bytes: u64) -> bool {
        self.1.fetch_add(1, Ordering::SeqCst) + 1 < self.0
    }
}

#[test]
fn resume_after_interruption_is_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 4);
    let clean = tmp.path().join("clean");
    forge_run::quantize(&src, &clean, &opts(32), &NoProgress).unwrap();
    let out = tmp.path().join("out");
    let e =
        forge_run::quantize(&src, &out, &opts(32), &StopAfter(2, AtomicUsize::new(0))).unwrap_err();
    assert!(matches!(e, Error::Interrupted), "{e}");
    assert!(!out.join("config.json").exists() && !out.join(forge_io::INDEX_FILE).exists());
    assert!(forge_run::verify::verify(&out).is_err());
    // Without --resume the directory is refused.
    let e = forge_run::quantize(&src, &out, &opts(32), &NoProgress).unwrap_err();
    assert!(e.to_string().contains("--resume"), "{e}");
    let mut r = opts(32);
    r.resume = true;
    let e = forge_run::quantize(&src, &out, &r, &StopAfter(1, AtomicUsize::new(0))).unwrap_err();
    assert!(matches!(e, Error::Interrupted));
    let rep = forge_run::quantize(&src, &out, &r, &NoProgress).unwrap();
    assert_eq!(rep.resumed_units, 3);
    assert_eq!(common::files(&out), common::files(&clean));
}

#[test]
fn errors_name_the_module_and_the_way_out() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 1);
    let e = forge_run::quantize(&src, &tmp.path().join("o"), &opts(128), &NoProgress).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Unpackable { .. }), "{msg}");
    assert!(
        msg.contains("model.layers.0.") && msg.contains("--exclude"),
        "{msg}"
    );
    assert!(
        !tmp.path().join("o").exists(),
        "nothing is written before the plan is valid"
    );
    let e = forge_run::quantize(&src, &src, &opts(32), &NoProgress).unwrap_err();
    assert!(e.to_string().contains("model directory"), "{e}");
    let e = forge_run::quantize(
        &tmp.path().join("missing"),
        &tmp.path().join("o"),
        &opts(32),
        &NoProgress,
    )
    .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
}

#[test]
fn fused_groups_follow_exclusions() {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 1);
    let mut o = opts(32);
    o.exclude = vec!["up_proj".into()];
    let rep = forge_run::quantize(&src, &tmp.path().join("o"), &o, &NoProgress).unwrap();
    assert_eq!(rep.quantized, 5); // q, k, v, o, down
    for m in ["mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj"] {
        assert!(
            rep.not_convert.contains(&format!("model.layers.0.{m}")),
            "{m}: {:?}",
            rep.not_convert
        );
    }
    assert!(rep.notes.iter().any(|n| n.contains("gate_up_proj")));
    forge_run::verify::verify(&tmp.path().join("o")).unwrap();
}

#[test]
fn cli_parses_sizes_and_reports_usage_errors() {
    assert_eq!(forge_run::cli::parse_size("5GB").unwrap(), 5_000_000_000);
    assert_eq!(forge_run::cli::parse_size("2GiB").unwrap(), 2 << 30);
    assert_eq!(forge_run::cli::parse_size("1234").unwrap(), 1234);
    assert!(forge_run::cli::parse_size("5 parsecs").is_err());
    assert!(forge_run::cli::parse_size("0").is_err());
    assert_eq!(forge_run::cli::main(["forge-rs", "quantize"]), 2);
    assert_eq!(
        forge_run::cli::main(["forge-rs", "verify", "/definitely/not/here"]),
        1
    );
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f16s(b: &[u8]) -> Vec<half::f16> {
    b.chunks(2)
        .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `(codes K × N, zeros K/G × N, scales K/G × N)` of `m` in any format, via forge-core's unpackers.
fn parts(
    ck: &Checkpoint,
    f: forge_run::OutputFormat,
    m: &str,
    k: usize,
    n: usize,
    g: usize,
) -> (Vec<u8>, Vec<u8>, Vec<half::f16>) {
    use forge_core::pack;
    let t = |s: &str| ck.tensor(&format!("{m}.{s}")).unwrap().bytes;
    match f {
        forge_run::OutputFormat::Awq => {
            let (c, z) =
                pack::unpack_awq(&i32s(t("qweight")), &i32s(t("qzeros")), k, n, g).unwrap();
            (c, z, f16s(t("scales")))
        }
        forge_run::OutputFormat::Gptq => {
            let (c, z) =
                pack::unpack_gptq(&i32s(t("qweight")), &i32s(t("qzeros")), k, n, g).unwrap();
            (c, z, f16s(t("scales")))
        }
        forge_run::OutputFormat::CompressedTensors => {
            let ct = pack::CompressedTensors {
                weight_packed: i32s(t("weight_packed")),
                weight_scale: f16s(t("weight_scale")),
                weight_shape: [n as i64, k as i64],
                weight_zero_point: ck
                    .get(&format!("{m}.weight_zero_point"))
                    .map(|z| i32s(z.bytes)),
            };
            pack::unpack_compressed(&ct, k, n, g).unwrap()
        }
    }
}

#[test]
fn every_format_verifies_and_holds_the_same_grid() {
    use forge_run::OutputFormat;
    let tmp = tempfile::tempdir().unwrap();
    let src = llama(&tmp.path().join("src"), 1);
    for symmetric in [true, false] {
        let mut grids = Vec::new();
        for f in OutputFormat::ALL {
            let o = Options {
                format: f,
                symmetric,
                // kv_b-like exclusion: an unquantized linear the config must list
                exclude: vec!["o_proj".into()],
                ..opts(32)
            };
            let out = tmp.path().join(format!("{}-{symmetric}", f.name()));
            let r = forge_run::quantize(&src, &out, &o, &NoProgress);
            if f == OutputFormat::Gptq && !symmetric {
                let e = r.unwrap_err().to_string();
                assert!(e.contains("format") && e.contains("sym"), "{e}");
                continue;
            }
            assert_eq!(r.unwrap().quantized, 6);
            let v = forge_run::verify::verify(&out).unwrap();
            assert_eq!((v.quantized, v.format.as_str()), (6, f.name()));
            let ck = Checkpoint::open(&out).unwrap();
            let m = "model.layers.0.mlp.down_proj";
            grids.push(parts(&ck, f, m, 128, 64, 32));
            assert!(ck.get("model.layers.0.self_attn.o_proj.weight").is_some());
        }
        assert!(grids.len() >= 2);
        assert!(grids.iter().all(|g| *g == grids[0]), "sym {symmetric}");
    }
    // Corruptions are named: a missing g_idx, a wrong weight_shape.
    let gptq = tmp.path().join("gptq-true");
    let ct = tmp.path().join("compressed-tensors-true");
    let rewrite = |dir: &Path, edit: &dyn Fn(&str, &mut Vec<u8>) -> bool| {
        let ck = Checkpoint::open(dir).unwrap();
        let mut keep: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for t in ck.iter() {
            let mut b = t.bytes.to_vec();
            if edit(t.name, &mut b) {
                keep.push((t.name.into(), t.dtype, t.shape.to_vec(), b));
            }
        }
        drop(ck);
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.to_string_lossy().contains(".safetensors") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let t: Vec<(String, Dtype, Vec<usize>)> = keep
            .iter()
            .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
            .collect();
        common::write_checkpoint(dir, &t, 1 << 30, |k, _, _, _| keep[k].3.clone());
    };
    rewrite(&gptq, &|n, _| n != "model.layers.0.mlp.up_proj.g_idx");
    let e = forge_run::verify::verify(&gptq).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.mlp.up_proj.g_idx"), "{e}");
    rewrite(&ct, &|n, b| {
        if n == "model.layers.0.mlp.up_proj.weight_shape" {
            b[..8].copy_from_slice(&7i64.to_le_bytes());
        }
        true
    });
    let e = forge_run::verify::verify(&ct).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight_shape") && e.contains("[7, 64]"),
        "{e}"
    );
}
