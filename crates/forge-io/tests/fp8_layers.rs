//! FP8 block dequantization and decoder-layer grouping.
#![allow(clippy::unwrap_used)]

mod common;

use common::{f32_bytes, open_bytes, shard};
use forge_io::{Error, E4M3_TO_F32};
use rand::{Rng, SeedableRng};

/// An `F8_E4M3` weight `[n, k]` with random non-NaN bytes and a `[nb, kb]`
/// scale; returns (file bytes, fp8 bytes, scales).
fn fp8_file(n: usize, k: usize, scale_shape: [usize; 2]) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let q: Vec<u8> = (0..n * k).map(|_| rng.random::<u8>() & 0xFE).collect(); // 0x7F/0xFF excluded
    let s: Vec<f32> = (0..scale_shape[0] * scale_shape[1])
        .map(|_| rng.random_range(0.01..2.0))
        .collect();
    let bytes = shard(&[
        (
            "model.layers.0.mlp.down_proj.weight",
            "F8_E4M3",
            &[n, k],
            &q,
        ),
        (
            "model.layers.0.mlp.down_proj.weight_scale_inv",
            "F32",
            &scale_shape,
            &f32_bytes(&s),
        ),
    ]);
    (bytes, q, s)
}

#[test]
fn fp8_block_dequant_matches_naive_loop() {
    // Neither dimension a multiple of 128, plus exact multiples.
    for (n, k) in [(300usize, 200usize), (128, 256), (1, 129), (0, 5)] {
        let shape = [n.div_ceil(128), k.div_ceil(128)];
        let (bytes, q, s) = fp8_file(n, k, shape);
        let (_dir, ck) = open_bytes(&bytes);
        let got = ck
            .unwrap()
            .dequantized_f32("model.layers.0.mlp.down_proj.weight")
            .unwrap();
        assert_eq!(got.len(), n * k);
        for r in 0..n {
            for c in 0..k {
                let want = E4M3_TO_F32[q[r * k + c] as usize] * s[(r / 128) * shape[1] + c / 128];
                assert_eq!(got[r * k + c].to_bits(), want.to_bits(), "[{r}, {c}]");
            }
        }
    }
}

#[test]
fn wrong_shaped_weight_scale_inv() {
    let (bytes, _, _) = fp8_file(300, 200, [3, 1]);
    let (_dir, ck) = open_bytes(&bytes);
    let err = ck
        .unwrap()
        .dequantized_f32("model.layers.0.mlp.down_proj.weight")
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Fp8Scale { .. }), "{msg}");
    assert!(msg.contains("down_proj.weight\"") && msg.contains("down_proj.weight_scale_inv"));
    assert!(msg.contains("[3, 2]") && msg.contains("[3, 1]"), "{msg}");
}

#[test]
fn fp8_without_scale_is_an_error_and_plain_weights_convert() {
    let bf16: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    let bytes = shard(&[
        ("lonely", "F8_E4M3", &[1, 1], &[0x38]),
        ("plain", "BF16", &[2], &bf16),
    ]);
    let (_dir, ck) = open_bytes(&bytes);
    let ck = ck.unwrap();
    let err = ck.dequantized_f32("lonely").unwrap_err();
    assert!(
        matches!(&err, Error::Fp8Scale { scale, .. } if scale == "lonely_scale_inv"),
        "{err}"
    );
    assert_eq!(ck.dequantized_f32("plain").unwrap(), [1.5, -2.0]);
    assert_eq!(ck.tensor("lonely").unwrap().to_f32().unwrap(), [1.0]);
}

#[test]
fn layers_are_grouped_under_the_decoder_prefix() {
    let b = [0u8; 2];
    let names = [
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.10.mlp.gate.weight",
        "model.language_model.layers.2.self_attn.q_proj.weight",
        "model.language_model.layers.2.input_layernorm.weight",
        "model.vision_tower.encoder.layers.0.attn.weight",
        "model.vision_tower.encoder.layers.1.attn.weight",
        "model.vision_tower.encoder.layers.2.attn.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ];
    let tensors: Vec<(&str, &str, &[usize], &[u8])> = names
        .iter()
        .map(|n| (*n, "BF16", &[1][..], &b[..]))
        .collect();
    let (_dir, ck) = open_bytes(&shard(&tensors));
    let ck = ck.unwrap();
    assert_eq!(ck.layer_prefix(), Some("model.language_model."));
    assert_eq!(ck.layers(), [2, 10]);
    assert_eq!(
        ck.layer_tensors(2),
        [
            "model.language_model.layers.2.self_attn.q_proj.weight",
            "model.language_model.layers.2.input_layernorm.weight"
        ]
    );
    assert!(ck.layer_tensors(3).is_empty());
    let rest = ck.non_layer_tensors();
    assert_eq!(rest.len(), 6);
    assert!(
        rest.contains(&"lm_head.weight")
            && rest.contains(&"model.vision_tower.encoder.layers.1.attn.weight")
    );
}
