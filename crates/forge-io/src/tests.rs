use crate::*;

/// Independent E4M3FN reference: value arithmetic, not bit placement.
fn e4m3_reference(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    (sign * v) as f32
}

#[test]
fn e4m3_table_is_exact() {
    for b in 0..=255u8 {
        let (got, want) = (E4M3_TO_F32[usize::from(b)], e4m3_reference(b));
        if want.is_nan() {
            assert!(got.is_nan(), "{b:#04x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{b:#04x}: {got} vs {want}");
        }
    }
    assert_eq!(E4M3_TO_F32[0x7E], 448.0);
    assert_eq!(E4M3_TO_F32[0xFE], -448.0);
    assert_eq!(E4M3_TO_F32[0x01], 2f32.powi(-9));
    assert_eq!(E4M3_TO_F32[0x08], 2f32.powi(-6));
    assert_eq!(E4M3_TO_F32[0x38], 1.0);
    assert!(E4M3_TO_F32[0x80] == 0.0 && E4M3_TO_F32[0x80].is_sign_negative());
    assert!(E4M3_TO_F32[0x7F].is_nan() && E4M3_TO_F32[0xFF].is_nan());
    assert_eq!(E4M3_TO_F32.iter().filter(|v| v.is_nan()).count(), 2);
}

#[test]
fn e5m2_decodes() {
    assert_eq!(e5m2_to_f32(0x3C), 1.0);
    assert_eq!(e5m2_to_f32(0x7B), 57344.0);
    assert_eq!(e5m2_to_f32(0x7C), f32::INFINITY);
    assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
}

#[test]
fn dtype_names_round_trip() {
    for d in Dtype::ALL {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
    }
    assert_eq!(Dtype::from_name("F8_E4M3FNUZ"), None);
    assert_eq!(Dtype::from_name("f32"), None);
}

#[test]
fn layer_names_split() {
    assert_eq!(
        split_layer_name("model.layers.3.mlp.up_proj.weight"),
        Some(("model.", 3))
    );
    assert_eq!(
        split_layer_name("model.language_model.layers.12.self_attn.q_proj.weight"),
        Some(("model.language_model.", 12))
    );
    assert_eq!(
        split_layer_name("layers.0.attention.wq.weight"),
        Some(("", 0))
    );
    assert_eq!(split_layer_name("model.extra_layers.1.x"), None);
    assert_eq!(split_layer_name("model.layers.x.y"), None);
    assert_eq!(split_layer_name("model.layers.7"), None);
    assert_eq!(split_layer_name("model.embed_tokens.weight"), None);
    assert_eq!(
        split_layer_name("a.extra_layers.1.layers.2.w"),
        Some(("a.extra_layers.1.", 2))
    );
}

fn spec(name: &str, dtype: Dtype, n: usize) -> TensorSpec {
    TensorSpec::new(name, dtype, [n])
}

#[test]
fn plan_packs_greedily_in_order() {
    let specs = [
        spec("a", Dtype::U8, 40),
        spec("b", Dtype::U8, 60),
        spec("c", Dtype::U8, 1),
        spec("big", Dtype::F32, 100),
        spec("d", Dtype::U8, 10),
    ];
    let plan = ShardPlan::new(specs, 100).unwrap();
    let files: Vec<Vec<&str>> = plan
        .shards()
        .iter()
        .map(|s| s.tensors.iter().map(|t| t.spec.name.as_str()).collect())
        .collect();
    assert_eq!(files, [vec!["a", "b"], vec!["c"], vec!["big"], vec!["d"]]);
    assert_eq!(
        plan.shards()[0].file_name,
        "model-00001-of-00004.safetensors"
    );
    assert_eq!(
        plan.shards()[3].file_name,
        "model-00004-of-00004.safetensors"
    );
    assert_eq!(plan.total_bytes(), 40 + 60 + 1 + 400 + 10);
    assert_eq!(
        plan.file_of("big"),
        Some("model-00003-of-00004.safetensors")
    );

    let one = ShardPlan::new([spec("x", Dtype::F16, 3)], DEFAULT_MAX_SHARD_BYTES).unwrap();
    assert_eq!(
        one.shards()[0].file_name,
        "model-00001-of-00001.safetensors"
    );
}

#[test]
fn plan_aligns_by_element_size() {
    let specs = [
        spec("u8", Dtype::U8, 3),
        spec("f16", Dtype::F16, 3),
        spec("f64", Dtype::F64, 1),
    ];
    let plan = ShardPlan::new(specs, 1000).unwrap();
    let layout: Vec<(&str, u64)> = plan.shards()[0]
        .tensors
        .iter()
        .map(|t| (t.spec.name.as_str(), t.offset))
        .collect();
    assert_eq!(layout, [("f64", 0), ("f16", 8), ("u8", 14)]);
    assert_eq!(plan.shards()[0].data_len, 17);
}

#[test]
fn plan_rejects_bad_input() {
    let dup = ShardPlan::new([spec("a", Dtype::U8, 1), spec("a", Dtype::U8, 1)], 10);
    assert!(matches!(dup, Err(Error::InvalidPlan { tensor, .. }) if tensor == "a"));
    assert!(ShardPlan::new([], 10).is_err());
    assert!(ShardPlan::new([spec("a", Dtype::U8, 1)], 0).is_err());
    let huge = TensorSpec::new("h", Dtype::F64, [usize::MAX, 2]);
    assert!(
        matches!(ShardPlan::new([huge], 10), Err(Error::InvalidPlan { tensor, .. }) if tensor == "h")
    );
}

#[test]
fn index_json_is_hf_shaped() {
    let plan = ShardPlan::new([spec("z", Dtype::U8, 8), spec("a", Dtype::U8, 8)], 8).unwrap();
    let v: serde_json::Value = serde_json::from_str(&plan.index_json()).unwrap();
    assert_eq!(v["metadata"]["total_size"], 16);
    assert_eq!(v["weight_map"]["z"], "model-00001-of-00002.safetensors");
    assert_eq!(v["weight_map"]["a"], "model-00002-of-00002.safetensors");
    let keys: Vec<&String> = v["weight_map"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["a", "z"]);
}

#[test]
fn types_are_thread_safe() {
    fn is<T: Send + Sync>() {}
    is::<Checkpoint>();
    is::<ShardWriter>();
    is::<Error>();
}

mod header_props {
    //! The header parser never panics: random bytes and random mutations of a
    //! valid file are `Err` or a header whose ranges lie inside the buffer.
    use proptest::prelude::*;
    use std::path::Path;

    fn valid() -> Vec<u8> {
        let header = br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F8_E4M3","shape":[5],"data_offsets":[12,17]},"c":{"dtype":"F32","shape":[1],"data_offsets":[20,24]}}"#;
        let mut h = header.to_vec();
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend(0..24u8);
        out
    }

    fn check(buf: &[u8]) {
        if let Ok(h) = crate::header::parse(Path::new("model.safetensors"), buf) {
            for e in &h.entries {
                assert!(e.range.end <= buf.len() && e.range.start <= e.range.end);
                let numel: usize = e.shape.iter().product();
                assert_eq!(e.range.len(), numel * e.dtype.size());
            }
        }
    }

    #[test]
    fn the_reference_header_parses() {
        let h = crate::header::parse(Path::new("m"), &valid()).unwrap();
        assert_eq!(h.entries.len(), 3);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..300)) {
            check(&buf);
        }

        #[test]
        fn random_length_prefix_never_panics(len in any::<u64>(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut buf = len.to_le_bytes().to_vec();
            buf.extend(tail);
            check(&buf);
        }

        #[test]
        fn mutated_valid_headers_never_panic(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let mut buf = valid();
            for (at, b) in edits {
                let i = at.index(buf.len());
                buf[i] = b;
            }
            if truncate {
                buf.truncate(cut.index(buf.len() + 1));
            }
            check(&buf);
        }

        #[test]
        fn digit_edits_in_shapes_and_offsets_never_panic(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), prop_oneof![Just(b'9'), Just(b'0'), Just(b'-'), Just(b'e'), Just(b','), Just(b']')]), 1..4),
        ) {
            // Mutations aimed at numbers: overflowing shapes, negative or reversed offsets.
            let mut buf = valid();
            let digits: Vec<usize> = (8..buf.len() - 24).filter(|&i| buf[i].is_ascii_digit()).collect();
            for (at, b) in edits {
                buf[digits[at.index(digits.len())]] = b;
            }
            check(&buf);
        }
    }
}
