//! One test per reader error path, on hand-made bytes.
#![allow(clippy::unwrap_used)]

mod common;

use common::{f32_bytes, index, open_bytes, put, raw, shard};
use forge_io::{Checkpoint, Dtype, Error};

/// Opens `bytes` as a one-file checkpoint and returns the error, checking
/// that its message names the file (and `tensor`, when given).
fn open_err(bytes: &[u8], tensor: Option<&str>) -> Error {
    let (_dir, res) = open_bytes(bytes);
    let err = res.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
    if let Some(t) = tensor {
        assert!(msg.contains(t), "{msg}");
    }
    err
}

#[test]
fn truncated_file() {
    let err = open_err(&[1, 0, 0], None);
    assert!(matches!(err, Error::Truncated { len: 3, .. }), "{err}");
}

#[test]
fn header_length_past_eof() {
    let mut bytes = 100u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}        ");
    let err = open_err(&bytes, None);
    assert!(
        matches!(
            err,
            Error::HeaderPastEof {
                header_len: 100,
                file_len: 18,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn header_too_large() {
    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let err = open_err(&bytes, None);
    assert!(matches!(err, Error::HeaderTooLarge { header_len, .. } if header_len == 1 << 40));
}

#[test]
fn garbage_json() {
    let err = open_err(&raw("{\"a\": [1, 2", &[]), None);
    assert!(matches!(err, Error::InvalidHeader { .. }), "{err}");
    let err = open_err(&raw("[1, 2]", &[]), None);
    assert!(matches!(err, Error::InvalidHeader { .. }), "{err}");
    let mut bytes = raw("{}", &[]);
    bytes[9] = 0xFF; // not UTF-8
    let err = open_err(&bytes, None);
    assert!(matches!(&err, Error::InvalidHeader { reason, .. } if reason.contains("UTF-8")));
}

#[test]
fn malformed_entry() {
    let h = r#"{"w":{"dtype":"F32","data_offsets":[0,4]}}"#;
    let err = open_err(&raw(h, &[0; 4]), Some("\"w\""));
    assert!(matches!(err, Error::InvalidEntry { .. }), "{err}");
    let h = r#"{"__metadata__":{"format":1}}"#;
    assert!(matches!(
        open_err(&raw(h, &[]), None),
        Error::InvalidEntry { .. }
    ));
}

#[test]
fn offsets_past_end() {
    let h = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let err = open_err(&raw(h, &[0; 4]), Some("\"w\""));
    assert!(
        matches!(
            err,
            Error::InvalidOffsets {
                end: 8,
                data_len: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn reversed_offsets() {
    let h = r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
    let err = open_err(&raw(h, &[0; 4]), Some("\"w\""));
    assert!(
        matches!(
            err,
            Error::InvalidOffsets {
                begin: 4,
                end: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn overlapping_ranges() {
    let h = r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},
                "b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#;
    let err = open_err(&raw(h, &[0; 12]), Some("\"b\""));
    assert!(matches!(&err, Error::Overlap { first, second, .. } if first == "a" && second == "b"));
}

#[test]
fn gaps_and_empty_tensors_are_tolerated() {
    let h = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},
                "e":{"dtype":"F32","shape":[0,3],"data_offsets":[10,10]},
                "b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let data: Vec<u8> = (0..12).collect();
    let (_dir, ck) = open_bytes(&raw(h, &data));
    let ck = ck.unwrap();
    assert_eq!(ck.names().collect::<Vec<_>>(), ["b", "a", "e"]);
    assert_eq!(ck.tensor("a").unwrap().bytes, [8, 9, 10, 11]);
    assert_eq!(ck.tensor("e").unwrap().numel(), 0);
    assert_eq!(ck.total_bytes(), 6);
}

#[test]
fn size_mismatch_vs_shape() {
    let h = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    let err = open_err(&raw(h, &[0; 8]), Some("\"w\""));
    assert!(
        matches!(
            err,
            Error::SizeMismatch {
                expected: 12,
                actual: 8,
                dtype: Dtype::F32,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn shape_overflow() {
    let h = r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#;
    let err = open_err(&raw(h, &[]), Some("\"w\""));
    assert!(matches!(err, Error::SizeOverflow { .. }), "{err}");
}

#[test]
fn unknown_dtype() {
    let h = r#"{"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}}"#;
    let err = open_err(&raw(h, &[0]), Some("\"w\""));
    assert!(
        matches!(&err, Error::UnknownDtype { dtype, .. } if dtype == "Q4_K"),
        "{err}"
    );
    assert!(err.to_string().contains("Q4_K"));
}

#[test]
fn duplicate_key_in_one_header() {
    let h = r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                "w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let err = open_err(&raw(h, &[0; 2]), Some("\"w\""));
    assert!(matches!(err, Error::Duplicate { .. }), "{err}");
}

/// Two shards `a.safetensors` {x, y} and `b.safetensors` {z}.
fn two_shards() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let one = f32_bytes(&[1.0]);
    put(
        dir.path(),
        "a.safetensors",
        &shard(&[("x", "F32", &[1], &one), ("y", "F32", &[1], &one)]),
    );
    put(
        dir.path(),
        "b.safetensors",
        &shard(&[("z", "F32", &[1], &one)]),
    );
    dir
}

fn open_dir_err(dir: &tempfile::TempDir) -> (Error, String) {
    let err = Checkpoint::open(dir.path()).unwrap_err();
    let msg = err.to_string();
    (err, msg)
}

#[test]
fn consistent_index_opens() {
    let dir = two_shards();
    index(
        dir.path(),
        &[
            ("x", "a.safetensors"),
            ("y", "a.safetensors"),
            ("z", "b.safetensors"),
        ],
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.names().collect::<Vec<_>>(), ["x", "y", "z"]);
    assert_eq!(ck.files().count(), 2);
    assert_eq!(ck.tensor("z").unwrap().to_f32().unwrap(), [1.0]);
}

#[test]
fn index_names_missing_file() {
    let dir = two_shards();
    let map = [
        ("x", "a.safetensors"),
        ("y", "a.safetensors"),
        ("z", "c.safetensors"),
    ];
    index(dir.path(), &map);
    let (err, msg) = open_dir_err(&dir);
    assert!(matches!(err, Error::MissingShard { .. }), "{err}");
    assert!(msg.contains("c.safetensors") && msg.contains("\"z\"") && msg.contains("index.json"));
}

#[test]
fn index_names_tensor_missing_from_its_shard() {
    let dir = two_shards();
    let map = [
        ("x", "a.safetensors"),
        ("y", "a.safetensors"),
        ("z", "b.safetensors"),
    ];
    index(
        dir.path(),
        &[map[0], map[1], map[2], ("ghost", "b.safetensors")],
    );
    let (err, msg) = open_dir_err(&dir);
    assert!(matches!(err, Error::NotInShard { .. }), "{err}");
    assert!(
        msg.contains("\"ghost\"") && msg.contains("b.safetensors"),
        "{msg}"
    );
}

#[test]
fn tensor_in_shard_but_not_in_index() {
    let dir = two_shards();
    index(
        dir.path(),
        &[("x", "a.safetensors"), ("z", "b.safetensors")],
    );
    let (err, msg) = open_dir_err(&dir);
    assert!(matches!(err, Error::Unindexed { .. }), "{err}");
    assert!(
        msg.contains("\"y\"") && msg.contains("a.safetensors"),
        "{msg}"
    );
}

#[test]
fn duplicate_names_across_shards() {
    let dir = two_shards();
    let one = f32_bytes(&[2.0]);
    put(
        dir.path(),
        "b.safetensors",
        &shard(&[("x", "F32", &[1], &one), ("z", "F32", &[1], &one)]),
    );
    index(
        dir.path(),
        &[
            ("x", "a.safetensors"),
            ("y", "a.safetensors"),
            ("z", "b.safetensors"),
        ],
    );
    let (err, msg) = open_dir_err(&dir);
    assert!(matches!(err, Error::Duplicate { .. }), "{err}");
    assert!(
        msg.contains("\"x\"") && msg.contains("a.safetensors") && msg.contains("b.safetensors")
    );
}

#[test]
fn index_must_be_well_formed() {
    let dir = two_shards();
    put(
        dir.path(),
        "model.safetensors.index.json",
        br#"{"weight_map": {"x": "../a.safetensors"}}"#,
    );
    assert!(matches!(open_dir_err(&dir).0, Error::InvalidIndex { .. }));
    put(dir.path(), "model.safetensors.index.json", b"{}");
    assert!(matches!(open_dir_err(&dir).0, Error::InvalidIndex { .. }));
}

#[test]
fn directory_without_a_checkpoint() {
    let dir = two_shards(); // two files, no index, no model.safetensors
    assert!(matches!(open_dir_err(&dir).0, Error::NoCheckpoint { .. }));
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(open_dir_err(&empty).0, Error::NoCheckpoint { .. }));
    let missing = Checkpoint::open(empty.path().join("nope")).unwrap_err();
    assert!(matches!(missing, Error::Io { .. }), "{missing}");
}

#[test]
fn pickle_only_folder_is_refused_with_a_conversion_recipe() {
    let dir = tempfile::tempdir().unwrap();
    // Not a valid pickle: any attempt to read it would fail differently.
    put(
        dir.path(),
        "pytorch_model-00001-of-00002.bin",
        b"\x80\x04garbage",
    );
    put(
        dir.path(),
        "pytorch_model-00002-of-00002.bin",
        b"\x80\x04garbage",
    );
    put(dir.path(), "pytorch_model.bin.index.json", b"{}");
    let (err, msg) = open_dir_err(&dir);
    assert!(matches!(err, Error::NoCheckpoint { .. }), "{msg}");
    assert!(
        msg.contains("pytorch_model-00001-of-00002.bin")
            && msg.contains("save_pretrained(")
            && msg.contains("safe_serialization=True"),
        "{msg}"
    );
}

#[test]
fn safetensors_are_preferred_over_pickles() {
    let dir = tempfile::tempdir().unwrap();
    put(dir.path(), "pytorch_model.bin", b"\x80\x04garbage");
    put(
        dir.path(),
        "model.safetensors",
        &shard(&[("a", "F32", &[1], &f32_bytes(&[1.5]))]),
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.tensor("a").unwrap().to_f32().unwrap(), vec![1.5]);
}

#[test]
fn lookup_and_conversion_errors() {
    let bytes = shard(&[("ids", "I32", &[2], &[0; 8])]);
    let (_dir, ck) = open_bytes(&bytes);
    let ck = ck.unwrap();
    let err = ck.tensor("ids").unwrap().to_f32().unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedDtype {
                dtype: Dtype::I32,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("\"ids\"") && err.to_string().contains("model.safetensors"));
    let err = ck.tensor("nope").unwrap_err();
    assert!(matches!(&err, Error::NotFound { tensor, .. } if tensor == "nope"));
}

#[test]
fn mutated_files_never_panic() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let good = shard(&[
        ("a", "BF16", &[2, 3], &[1; 12]),
        ("b", "F8_E4M3", &[5], &[2; 5]),
        ("c", "F32", &[1], &[3; 4]),
    ]);
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..500 {
        let mut bytes = good.clone();
        for _ in 0..rng.random_range(1..4) {
            let i = rng.random_range(0..bytes.len());
            bytes[i] = rng.random();
        }
        bytes.truncate(rng.random_range(0..=bytes.len()));
        put(dir.path(), "model.safetensors", &bytes);
        if let Ok(ck) = Checkpoint::open(dir.path()) {
            for t in ck.iter() {
                assert_eq!(t.bytes.len(), t.numel() * t.dtype.size());
                let _ = ck.dequantized_f32(t.name);
            }
        }
    }
}
