//! Expert pruning on a tiny DeepSeek-like MoE checkpoint: compact and remap
//! layouts (outputs named by compact slot, router rows and bias sliced, config
//! count and `forge_expert_pruning` block), binding, resume of a binding,
//! verify of pruned outputs, router statistics errors, and stats-only runs.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use forge_io::{Checkpoint, Dtype, ShardPlan, ShardWriter, TensorSpec};
use forge_run::cli::Outcome;
use forge_run::options::{Criterion, Method, Size};
use forge_run::{NoProgress, Options, Session};
use serde_json::{json, Value};

const E: usize = 8;

fn moe(dir: &Path) -> PathBuf {
    let (h, v) = (64usize, 96usize);
    let mut t: Vec<(String, Dtype, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), Dtype::BF16, vec![v, h]),
        ("model.norm.weight".into(), Dtype::BF16, vec![h]),
        ("lm_head.weight".into(), Dtype::BF16, vec![v, h]),
    ];
    let p = "model.layers.0.";
    for (n, s) in [
        ("self_attn.o_proj.weight", vec![h, h]),
        ("mlp.gate_proj.weight", vec![128, h]),
        ("mlp.up_proj.weight", vec![128, h]),
        ("mlp.down_proj.weight", vec![h, 128]),
        ("input_layernorm.weight", vec![h]),
    ] {
        t.push((format!("{p}{n}"), Dtype::BF16, s));
    }
    for l in [1, 2] {
        let p = format!("model.layers.{l}.");
        t.push((
            format!("{p}self_attn.o_proj.weight"),
            Dtype::BF16,
            vec![h, h],
        ));
        t.push((format!("{p}input_layernorm.weight"), Dtype::BF16, vec![h]));
        t.push((format!("{p}mlp.gate.weight"), Dtype::BF16, vec![E, h]));
        t.push((
            format!("{p}mlp.gate.e_score_correction_bias"),
            Dtype::F32,
            vec![E],
        ));
        for e in 0..E {
            for (n, s) in [
                ("gate_proj.weight", vec![32, h]),
                ("up_proj.weight", vec![32, h]),
                ("down_proj.weight", vec![h, 32]),
            ] {
                t.push((format!("{p}mlp.experts.{e}.{n}"), Dtype::BF16, s));
            }
        }
    }
    common::write_checkpoint(dir, &t, 100_000, |k, _, d, n| {
        common::random_bytes(d, n, k as u64)
    });
    let cfg = json!({
        "model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": h,
        "n_routed_experts": E, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_intermediate_size": 32, "num_nextn_predict_layers": 1,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir.into()
}

fn llama(dir: &Path) -> PathBuf {
    let specs = vec![
        TensorSpec::new("model.embed_tokens.weight", Dtype::BF16, vec![96, 64]),
        TensorSpec::new(
            "model.layers.0.mlp.up_proj.weight",
            Dtype::BF16,
            vec![64, 64],
        ),
    ];
    let w = ShardWriter::create(
        dir,
        ShardPlan::new(specs.clone(), 1 << 30).unwrap(),
        &BTreeMap::new(),
    )
    .unwrap();
    for s in &specs {
        w.write_tensor(
            &s.name,
            &common::random_bytes(s.dtype, s.shape.iter().product(), 1),
        )
        .unwrap();
    }
    w.finish().unwrap();
    std::fs::write(
        dir.join("config.json"),
        json!({"model_type": "llama", "num_hidden_layers": 1}).to_string(),
    )
    .unwrap();
    dir.into()
}

/// A router statistics file; `tweak` edits the tensors and the `forge` metadata first.
fn stats(
    path: &Path,
    layers: &[i64],
    counts: &[Vec<f64>],
    tweak: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, &mut Value),
) -> PathBuf {
    let l = layers.len();
    let e = counts.first().map_or(0, Vec::len);
    let flat = |f: &dyn Fn(f64) -> f64| -> Vec<u8> {
        counts
            .iter()
            .flatten()
            .flat_map(|x| f(*x).to_le_bytes())
            .collect()
    };
    let mut t = vec![
        (
            "layers".to_string(),
            Dtype::I64,
            vec![l],
            layers.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        ("counts".into(), Dtype::F64, vec![l, e], flat(&|x| x)),
        ("mass".into(), Dtype::F64, vec![l, e], flat(&|x| x / 10.0)),
        ("reap".into(), Dtype::F64, vec![l, e], flat(&|x| x * x)),
    ];
    let mut meta = json!({"format": "4bit-forge router stats v1", "scoring": "sigmoid", "num_experts": e, "model": "deepseek_v3"});
    tweak(&mut t, &mut meta);
    let tmp = path.with_extension("d");
    let specs: Vec<TensorSpec> = t
        .iter()
        .map(|(n, d, s, _)| TensorSpec::new(n.clone(), *d, s.clone()))
        .collect();
    let plan = ShardPlan::new(specs, 1 << 30).unwrap();
    let file = plan.shards()[0].file_name.clone();
    let mut md = BTreeMap::new();
    md.insert("forge".to_string(), meta.to_string());
    let w = ShardWriter::create(&tmp, plan, &md).unwrap();
    for (n, _, _, b) in &t {
        w.write_tensor(n, b).unwrap();
    }
    w.finish().unwrap();
    std::fs::rename(tmp.join(file), path).unwrap();
    path.into()
}

/// Layer 1: frequency ranks 0,1,2,3 best overall; balanced over 2 groups: 0,1 and 6,7.
fn good_stats(dir: &Path) -> PathBuf {
    stats(
        &dir.join("router_stats.safetensors"),
        &[1],
        &[vec![9.0, 8.0, 7.0, 6.0, 1.0, 0.0, 3.0, 2.0]],
        |_, _| {},
    )
}

fn opts() -> Options {
    Options {
        group_size: 32,
        max_shard_size: Size::Bytes(60_000),
        criterion: Criterion::Frequency,
        ..Options::default()
    }
}

fn config(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn compact_copy_slices_router_and_renames_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let out = tmp.path().join("out");
    let o = Options {
        method: Method::None,
        keep_experts: Some(4),
        router_stats: Some(good_stats(tmp.path())),
        ..opts()
    };
    let rep = forge_run::quantize(&src, &out, &o, &NoProgress).unwrap();
    assert_eq!(rep.quantized, 0);
    let keep = [0usize, 1, 6, 7];
    let a = Checkpoint::open(&src).unwrap();
    let b = Checkpoint::open(&out).unwrap();
    let p = "model.layers.1.mlp.";
    for (c, &id) in keep.iter().enumerate() {
        for leaf in ["gate_proj", "up_proj", "down_proj"] {
            assert_eq!(
                b.tensor(&format!("{p}experts.{c}.{leaf}.weight"))
                    .unwrap()
                    .bytes,
                a.tensor(&format!("{p}experts.{id}.{leaf}.weight"))
                    .unwrap()
                    .bytes
            );
        }
    }
    assert!(b.names().all(|n| !n.contains("experts.4.")));
    assert!(
        b.names().all(|n| !n.starts_with("model.layers.2.")),
        "MTP layer dropped"
    );
    let rows = |name: &str, ck: &Checkpoint, ids: &[usize]| -> Vec<u8> {
        let t = ck.tensor(name).unwrap();
        let w = t.bytes.len() / t.shape[0];
        ids.iter()
            .flat_map(|&r| t.bytes[r * w..(r + 1) * w].to_vec())
            .collect()
    };
    for name in ["gate.weight", "gate.e_score_correction_bias"] {
        let n = format!("{p}{name}");
        assert_eq!(b.tensor(&n).unwrap().shape[0], 4);
        assert_eq!(b.tensor(&n).unwrap().bytes, rows(&n, &a, &keep).as_slice());
    }
    assert_eq!(
        b.tensor("model.layers.0.mlp.up_proj.weight").unwrap().bytes,
        a.tensor("model.layers.0.mlp.up_proj.weight").unwrap().bytes
    );
    let cfg = config(&out);
    assert!(cfg.get("quantization_config").is_none());
    assert_eq!(cfg["n_routed_experts"], 4);
    assert_eq!(cfg["num_nextn_predict_layers"], 0);
    assert_eq!(
        cfg["forge_expert_pruning"],
        json!({"layout": "compact", "criterion": "frequency", "num_original_experts": 8,
               "expert_map": {"1": [0, 1, -1, -1, -1, -1, 2, 3]}})
    );
    let v = forge_run::verify::verify(&out).unwrap();
    assert_eq!(v.format, "none");
}

#[test]
fn compact_rtn_matches_unpruned_experts_and_verify_rejects_extra() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let full = tmp.path().join("full");
    forge_run::quantize(&src, &full, &opts(), &NoProgress).unwrap();
    let out = tmp.path().join("out");
    let o = Options {
        prune_ratio: Some(0.5),
        router_stats: Some(good_stats(tmp.path())),
        ..opts()
    };
    let rep = forge_run::quantize(&src, &out, &o, &NoProgress).unwrap();
    // layer 0: o_proj + 3; layer 1: o_proj + 4 experts × 3
    assert_eq!(rep.quantized, 4 + 1 + 12);
    forge_run::verify::verify(&out).unwrap();
    let a = Checkpoint::open(&full).unwrap();
    let b = Checkpoint::open(&out).unwrap();
    for s in ["qweight", "qzeros", "scales"] {
        assert_eq!(
            b.tensor(&format!("model.layers.1.mlp.experts.2.down_proj.{s}"))
                .unwrap()
                .bytes,
            a.tensor(&format!("model.layers.1.mlp.experts.6.down_proj.{s}"))
                .unwrap()
                .bytes
        );
    }
    let mut cfg = config(&out);
    assert_eq!(cfg["quantization_config"]["quant_method"], "awq");
    let nc = cfg["quantization_config"]["modules_to_not_convert"].to_string();
    assert!(nc.contains("model.layers.1.mlp.gate\""), "{nc}");
    // The checkpoint now holds an expert id the config does not allow.
    cfg["n_routed_experts"] = json!(3);
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let r = forge_run::verify::check(&out).unwrap();
    assert!(
        r.problems.iter().any(|p| p.contains("expert id")),
        "{:?}",
        r.problems
    );
}

#[test]
fn remap_keeps_router_and_allows_per_layer_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let out = tmp.path().join("out");
    let o = Options {
        remap: true,
        keep_mass: Some(0.7),
        router_stats: Some(good_stats(tmp.path())),
        ..opts()
    };
    forge_run::quantize(&src, &out, &o, &NoProgress).unwrap();
    forge_run::verify::verify(&out).unwrap();
    // counts 9 8 7 6 3 2 1 0 of 36: 70 % = 25.2 → 9+8+7+6 = 30 → 4 experts
    let cfg = config(&out);
    assert_eq!(cfg["n_routed_experts"], 8);
    assert_eq!(cfg["forge_expert_pruning"]["layout"], "remap");
    assert_eq!(
        cfg["forge_expert_pruning"]["expert_map"]["1"],
        json!([0, 1, 2, 3, -1, -1, -1, -1])
    );
    let a = Checkpoint::open(&src).unwrap();
    let b = Checkpoint::open(&out).unwrap();
    for n in [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ] {
        assert_eq!(a.tensor(n).unwrap().bytes, b.tensor(n).unwrap().bytes);
    }
    // MTP layer kept whole in remap.
    assert!(b
        .get("model.layers.2.mlp.experts.7.up_proj.weight")
        .is_some());
    assert!(b
        .get("model.layers.1.mlp.experts.4.up_proj.qweight")
        .is_none());
    assert!(b
        .get("model.layers.1.mlp.experts.3.up_proj.qweight")
        .is_some());
}

fn calib(dir: &Path) -> PathBuf {
    let p = dir.join("calib.txt");
    std::fs::write(&p, "some text").unwrap();
    p
}

#[test]
fn bind_errors_and_resume_restores_binding() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let out = tmp.path().join("out");
    let o = Options {
        keep_experts: Some(4),
        calib: Some(calib(tmp.path())),
        ..opts()
    };
    let mut s = Session::open(&src, &out, &o).unwrap();
    let moe_unit = s
        .plan()
        .units
        .iter()
        .position(|u| u.layer == Some(1))
        .unwrap();
    let u = s.unit(moe_unit).unwrap();
    let x = u.experts.as_ref().unwrap();
    assert_eq!(
        (x.keep, x.prefix.as_str()),
        (4, "model.layers.1.mlp.experts.")
    );
    assert!(u
        .linears
        .iter()
        .any(|l| l.module == "model.layers.1.mlp.experts.3.up_proj" && l.weight.is_empty()));
    assert!(u.outputs.iter().all(|o| !o.contains("experts.4.")));
    let e = s.write_unquantized(moe_unit).unwrap_err().to_string();
    assert!(e.contains("bind_experts"), "{e}");
    let e = s.quantize_rtn(moe_unit).unwrap_err().to_string();
    assert!(e.contains("bind_experts"), "{e}");
    for (ids, why) in [
        (vec![0, 1, 6], "3 ids"),
        (vec![1, 0, 6, 7], "sorted"),
        (vec![0, 1, 6, 8], "out of range"),
        (vec![0, 1, 2, 3], "group 0 keeps 4"),
    ] {
        let e = s.bind_experts(1, &ids).unwrap_err().to_string();
        assert!(e.contains(why), "{ids:?}: {e}");
    }
    let e = s.bind_experts(0, &[0, 1, 6, 7]).unwrap_err().to_string();
    assert!(e.contains("not a pruned MoE layer"), "{e}");
    s.bind_experts(1, &[0, 2, 5, 7]).unwrap();
    s.bind_experts(1, &[0, 2, 5, 7]).unwrap();
    let e = s.bind_experts(1, &[0, 1, 6, 7]).unwrap_err().to_string();
    assert!(e.contains("already bound"), "{e}");
    assert_eq!(s.expert_map()[&1], vec![0, -1, 1, -1, -1, 2, -1, 3]);
    let u = s.unit(moe_unit).unwrap();
    assert!(u
        .linears
        .iter()
        .any(|l| l.module == "model.layers.1.mlp.experts.2.up_proj"
            && l.weight == "model.layers.1.mlp.experts.5.up_proj.weight"));
    for i in 0..=moe_unit {
        s.write_unquantized(i).unwrap();
        s.quantize_rtn(i).unwrap();
        s.commit(i, None).unwrap();
    }
    drop(s); // as a crash would
    let r = Options {
        resume: true,
        ..o.clone()
    };
    let mut s = Session::open(&src, &out, &r).unwrap();
    assert_eq!(s.expert_map()[&1], vec![0, -1, 1, -1, -1, 2, -1, 3]);
    let e = s.bind_experts(1, &[0, 1, 6, 7]).unwrap_err().to_string();
    assert!(e.contains("already bound"), "{e}");
    for i in 0..s.plan().units.len() {
        if !s.is_done(i) {
            s.write_unquantized(i).unwrap();
            s.quantize_rtn(i).unwrap();
            s.commit(i, None).unwrap();
        }
    }
    s.finish(&[]).unwrap();
    forge_run::verify::verify(&out).unwrap();
    assert_eq!(
        config(&out)["forge_expert_pruning"]["expert_map"]["1"],
        json!([0, -1, 1, -1, -1, 2, -1, 3])
    );
}

#[test]
fn keep_counts_vllm_would_reject_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let c = calib(tmp.path());
    let open = |o: Options| {
        Session::open(&src, &tmp.path().join("o"), &o)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    for (k, why) in [
        (9, "only 8"),
        (3, "multiple of n_group"),
        (2, "at least 2"),
        (1, "num_experts_per_tok"),
    ] {
        let e = open(Options {
            keep_experts: Some(k),
            calib: Some(c.clone()),
            ..opts()
        });
        assert!(e.contains("keep_experts") && e.contains(why), "{k}: {e}");
    }
    let e = open(Options {
        prune_ratio: Some(0.8),
        calib: Some(c.clone()),
        ..opts()
    });
    assert!(e.contains("prune_ratio") && e.contains("at least 2"), "{e}");
    let l = llama(&tmp.path().join("llama"));
    let e = Session::open(
        &l,
        &tmp.path().join("l"),
        &Options {
            keep_experts: Some(2),
            calib: Some(c),
            ..opts()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("routed experts"), "{e}");
}

#[test]
fn router_stats_errors_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let row = vec![1.0; E];
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            stats(
                &tmp.path().join("a.safetensors"),
                &[1],
                std::slice::from_ref(&row),
                |t, _| t.retain(|x| x.0 != "reap"),
            ),
            "no tensor \"reap\"",
        ),
        (
            stats(
                &tmp.path().join("b.safetensors"),
                &[1],
                &[vec![1.0; 7]],
                |_, m| m["num_experts"] = json!(7),
            ),
            "7 experts per layer",
        ),
        (
            stats(
                &tmp.path().join("c.safetensors"),
                &[0],
                std::slice::from_ref(&row),
                |_, _| {},
            ),
            "layer 0 is not an MoE layer",
        ),
        (
            stats(
                &tmp.path().join("d.safetensors"),
                &[1],
                std::slice::from_ref(&row),
                |t, _| t[1].1 = Dtype::I64,
            ),
            "expected F64",
        ),
        (
            stats(&tmp.path().join("e.safetensors"), &[1], &[row], |_, m| {
                m["model"] = json!("qwen3_moe")
            }),
            "qwen3_moe",
        ),
    ];
    for (path, why) in cases {
        let o = Options {
            keep_experts: Some(4),
            router_stats: Some(path.clone()),
            ..opts()
        };
        let e = forge_run::quantize(&src, &tmp.path().join("o"), &o, &NoProgress)
            .unwrap_err()
            .to_string();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(e.contains(why) && e.contains(&name), "{why}: {e}");
    }
}

#[test]
fn stats_only_writes_only_extras() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let out = tmp.path().join("out");
    let o = Options {
        stats_only: true,
        calib: Some(calib(tmp.path())),
        criterion: Criterion::Reap,
        ..opts()
    };
    let mut s = Session::open(&src, &out, &o).unwrap();
    assert!(s.plan().specs.is_empty());
    assert!(s.plan().units.iter().all(|u| u.outputs.is_empty()));
    for i in 0..s.plan().units.len() {
        s.write_unquantized(i).unwrap();
        s.commit(i, None).unwrap();
    }
    let rep = s
        .finish(&[("forge/router_stats.safetensors".into(), b"x".to_vec())])
        .unwrap();
    assert_eq!(rep.shards, 0);
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    assert_eq!(names, vec!["forge".to_string()]);
    let r = forge_run::verify::check(&out).unwrap();
    assert!(
        r.problems.len() == 1 && r.problems[0].contains("router statistics only"),
        "{:?}",
        r.problems
    );
}

#[test]
fn cli_prune_hands_every_pruning_run_to_python_and_the_native_run_prunes_from_stats() {
    let tmp = tempfile::tempdir().unwrap();
    let src = moe(&tmp.path().join("src"));
    let st = good_stats(tmp.path());
    let s = |p: &Path| p.display().to_string();
    let out = tmp.path().join("out");
    let argv = [
        "forge-rs".into(),
        "prune".into(),
        s(&src),
        s(&out),
        "--router-stats".into(),
        s(&st),
        "--keep-experts".into(),
        "4".into(),
        "--group-size".into(),
        "32".into(),
        "--no-progress".into(),
    ];
    // The CLI hands it to the Python package (which also writes the expert map and report) ...
    let options = match forge_run::cli::dispatch::<_, String>(argv) {
        Outcome::Calibrate { options, .. } => options,
        o => panic!("{o:?}"),
    };
    assert_eq!(options["keep_experts"], json!(4));
    // ... and the Rust run itself prunes from saved statistics with no forward pass.
    let opts = forge_run::Options::from_json(&options).unwrap();
    forge_run::quantize(&src, &out, &opts, &forge_run::NoProgress).unwrap();
    assert_eq!(config(&out)["n_routed_experts"], 4);
    forge_run::verify::verify(&out).unwrap();
    let argv = [
        "forge-rs".into(),
        "prune".into(),
        s(&src),
        s(&tmp.path().join("o2")),
        "--calib".into(),
        s(&calib(tmp.path())),
        "--prune-ratio".into(),
        "0.5".into(),
        "--criterion".into(),
        "mass".into(),
    ];
    match forge_run::cli::dispatch::<_, String>(argv) {
        Outcome::Calibrate { options, .. } => {
            assert_eq!(options["prune_ratio"], json!(0.5));
            assert_eq!(options["criterion"], "mass");
        }
        o => panic!("{o:?}"),
    }
    let argv = ["forge-rs", "prune", "a", "b", "--method", "none"];
    assert!(matches!(forge_run::cli::dispatch(argv), Outcome::Exit(1)));
}
