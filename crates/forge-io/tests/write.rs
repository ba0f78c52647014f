//! Writer round trips, compatibility with the `safetensors` crate, and the
//! writer's error paths.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use forge_io::{Checkpoint, Dtype, Error, ShardPlan, ShardWriter, TensorSpec, INDEX_FILE};
use rand::{Rng, SeedableRng};

/// Random tensors of mixed dtypes: (spec, bytes).
fn tensors(count: usize) -> Vec<(TensorSpec, Vec<u8>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let dtypes = [
        Dtype::BF16,
        Dtype::F32,
        Dtype::I32,
        Dtype::U8,
        Dtype::F8_E4M3,
        Dtype::F64,
        Dtype::F16,
    ];
    (0..count)
        .map(|i| {
            let dtype = dtypes[i % dtypes.len()];
            let shape = vec![rng.random_range(1..40), rng.random_range(1..9)];
            let len = shape.iter().product::<usize>() * dtype.size();
            let bytes = (0..len).map(|_| rng.random()).collect();
            (
                TensorSpec::new(format!("model.layers.{}.w{i}", i / 4), dtype, shape),
                bytes,
            )
        })
        .collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn write_all(dir: &Path, data: &[(TensorSpec, Vec<u8>)], max: u64) -> ShardPlan {
    let plan = ShardPlan::new(data.iter().map(|(s, _)| s.clone()), max).unwrap();
    let meta = BTreeMap::from([("producer".to_string(), "forge-io test".to_string())]);
    let writer = ShardWriter::create(dir, plan.clone(), &meta).unwrap();
    // Out of order, from several threads at once.
    std::thread::scope(|scope| {
        for part in data.rchunks(5) {
            let writer = &writer;
            scope.spawn(move || {
                part.iter()
                    .for_each(|(s, b)| writer.write_tensor(&s.name, b).unwrap())
            });
        }
    });
    assert!(writer.unwritten().is_empty());
    writer.finish().unwrap();
    plan
}

#[test]
fn multi_shard_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let data = tensors(23);
    let plan = write_all(dir.path(), &data, 1500);
    let n = plan.shards().len();
    assert!(n >= 3, "{n} shards");
    let mut expected: Vec<String> = plan.shards().iter().map(|s| s.file_name.clone()).collect();
    expected.push(INDEX_FILE.into());
    expected.sort();
    assert_eq!(files_in(dir.path()), expected, "no .partial left");

    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.len(), data.len());
    assert_eq!(ck.total_bytes(), plan.total_bytes());
    assert_eq!(ck.metadata().get("format").map(String::as_str), Some("pt"));
    assert_eq!(
        ck.metadata().get("producer").map(String::as_str),
        Some("forge-io test")
    );
    for (spec, bytes) in &data {
        let t = ck.tensor(&spec.name).unwrap();
        assert_eq!((t.dtype, t.shape), (spec.dtype, &spec.shape[..]));
        assert_eq!(t.bytes, &bytes[..], "{}", spec.name);
        assert!(t.file.ends_with(plan.file_of(&spec.name).unwrap()));
    }
    assert_eq!(ck.layers(), (0..6).collect::<Vec<_>>());
    // Releasing pages is only a residency hint: the bytes read back the same.
    ck.release(
        data.iter()
            .map(|(spec, _)| spec.name.as_str())
            .chain(["no.such.tensor"]),
    );
    for (spec, bytes) in &data {
        assert_eq!(
            ck.tensor(&spec.name).unwrap().bytes,
            &bytes[..],
            "{}",
            spec.name
        );
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], plan.total_bytes());
}

#[test]
fn written_shards_load_with_the_safetensors_crate() {
    let dir = tempfile::tempdir().unwrap();
    let data = tensors(12);
    let plan = write_all(dir.path(), &data, 2000);
    let by_name: HashMap<&str, &(TensorSpec, Vec<u8>)> =
        data.iter().map(|t| (t.0.name.as_str(), t)).collect();
    let mut seen = 0;
    for shard in plan.shards() {
        let buf = std::fs::read(dir.path().join(&shard.file_name)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
        for (name, view) in st.tensors() {
            let (spec, bytes) = by_name[name.as_str()];
            assert_eq!(view.data(), &bytes[..]);
            assert_eq!(
                (view.dtype().to_string().as_str(), view.shape()),
                (spec.dtype.name(), &spec.shape[..])
            );
            seen += 1;
        }
    }
    assert_eq!(seen, data.len());
}

#[test]
fn reads_files_made_by_safetensors_serialize() {
    use safetensors::tensor::TensorView as StView;
    use safetensors::Dtype as St;
    let data = tensors(14);
    let to_st = |d: Dtype| match d {
        Dtype::BF16 => St::BF16,
        Dtype::F32 => St::F32,
        Dtype::I32 => St::I32,
        Dtype::U8 => St::U8,
        Dtype::F8_E4M3 => St::F8_E4M3,
        Dtype::F64 => St::F64,
        _ => St::F16,
    };
    let views = data.iter().map(|(s, b)| {
        (
            s.name.clone(),
            StView::new(to_st(s.dtype), s.shape.clone(), b).unwrap(),
        )
    });
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(meta)).unwrap();
    let (_dir, ck) = common::open_bytes(&bytes);
    let ck = ck.unwrap();
    assert_eq!(ck.len(), data.len());
    for (spec, b) in &data {
        let t = ck.tensor(&spec.name).unwrap();
        assert_eq!(
            (t.dtype, t.shape, t.bytes),
            (spec.dtype, &spec.shape[..], &b[..])
        );
    }
}

fn small_plan() -> ShardPlan {
    let specs = [
        TensorSpec::new("a", Dtype::F32, [4]),
        TensorSpec::new("b", Dtype::F32, [2048]),
        TensorSpec::new("c", Dtype::U8, [8]),
    ];
    ShardPlan::new(specs, 16).unwrap()
}

#[test]
fn writer_byte_length_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::create(dir.path(), small_plan(), &BTreeMap::new()).unwrap();
    let err = w.write_tensor("a", &[0; 12]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WriteLength {
                expected: 16,
                actual: 12,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("\"a\"") && msg.contains("model-00001-of-00003.safetensors.partial"),
        "{msg}"
    );
    // The failed attempt did not count: a correct write still succeeds, once.
    w.write_tensor("a", &[0; 16]).unwrap();
    assert!(matches!(
        w.write_tensor("a", &[0; 16]),
        Err(Error::AlreadyWritten { .. })
    ));
    assert!(matches!(
        w.write_tensor("zz", &[]),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn writer_missing_tensor_at_finish_leaves_no_final_file() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::create(dir.path(), small_plan(), &BTreeMap::new()).unwrap();
    w.write_tensor("a", &[1; 16]).unwrap();
    w.write_tensor("c", &[2; 8]).unwrap();
    assert_eq!(w.unwritten(), ["b"]);
    let err = w.finish().unwrap_err();
    assert!(
        matches!(&err, Error::Unwritten { missing, .. } if missing.len() == 1 && missing[0].0 == "b")
    );
    assert!(
        err.to_string().contains("model-00002-of-00003.safetensors"),
        "{err}"
    );
    assert!(
        files_in(dir.path()).iter().all(|f| f.ends_with(".partial")),
        "{:?}",
        files_in(dir.path())
    );
}

#[test]
fn dropped_writer_leaves_only_partial_files() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::create(dir.path(), small_plan(), &BTreeMap::new()).unwrap();
    w.write_tensor("a", &[1; 16]).unwrap();
    drop(w);
    let files = files_in(dir.path());
    assert_eq!(files.len(), 3);
    assert!(
        files.iter().all(|f| f.ends_with(".safetensors.partial")),
        "{files:?}"
    );
    assert!(Checkpoint::open(dir.path()).is_err());
}

#[test]
fn create_or_reopen_keeps_earlier_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let meta = BTreeMap::new();
    let w = ShardWriter::create(dir.path(), small_plan(), &meta).unwrap();
    w.write_tensor("a", &[7; 16]).unwrap();
    drop(w); // interrupted run

    let w = ShardWriter::create_or_reopen(dir.path(), small_plan(), &meta).unwrap();
    assert_eq!(w.reopened_files().len(), 3);
    assert!(!w.is_written("a"));
    w.mark_written("a").unwrap();
    assert!(matches!(
        w.mark_written("a"),
        Err(Error::AlreadyWritten { .. })
    ));
    w.write_tensor("b", &[8; 8192]).unwrap();
    w.write_tensor("c", &[9; 8]).unwrap();
    w.finish().unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.tensor("a").unwrap().bytes, [7; 16]);
    assert_eq!(ck.tensor("c").unwrap().bytes, [9; 8]);

    // A different plan (other metadata → other header) starts fresh.
    let w = ShardWriter::create(dir.path(), small_plan(), &meta).unwrap();
    drop(w);
    let other = BTreeMap::from([("k".to_string(), "v".to_string())]);
    let w = ShardWriter::create_or_reopen(dir.path(), small_plan(), &other).unwrap();
    assert!(w.reopened_files().is_empty());
    assert!(matches!(
        w.mark_written("a"),
        Err(Error::NotReopened { .. })
    ));
}

#[test]
fn full_disk_surfaces_enospc_with_the_file_name() {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let partial = dir.path().join("model-00001-of-00003.safetensors.partial");
    std::os::unix::fs::symlink("/dev/full", &partial).unwrap();
    let err = ShardWriter::create(dir.path(), small_plan(), &BTreeMap::new()).unwrap_err();
    let Error::Io { source, path, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{err}");
    assert_eq!(path, &partial);
    assert!(
        err.to_string()
            .contains("model-00001-of-00003.safetensors.partial"),
        "{err}"
    );
}

/// Environment variable that turns `file_size_limit_child` into the real test.
const CHILD_DIR: &str = "FORGE_IO_FSIZE_CHILD_DIR";

#[test]
fn file_size_limit_surfaces_on_the_tensor_write() {
    // The parent lays out the files; a child under `ulimit -f 1` (1 KiB, with
    // SIGXFSZ ignored) reopens them and writes tensor "b" at offset ≥ 1 KiB.
    let dir = tempfile::tempdir().unwrap();
    drop(ShardWriter::create(dir.path(), small_plan(), &BTreeMap::new()).unwrap());
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("bash")
        .args([
            "-c",
            "trap '' XFSZ; ulimit -f 1; exec \"$0\" file_size_limit_child --exact --nocapture",
        ])
        .arg(exe)
        .env(CHILD_DIR, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD-OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn file_size_limit_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let w = ShardWriter::create_or_reopen(&dir, small_plan(), &BTreeMap::new()).unwrap();
    assert_eq!(w.reopened_files().len(), 3);
    let err = w.write_tensor("b", &[1; 8192]).unwrap_err();
    let Error::Io {
        source,
        tensor,
        path,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::FileTooLarge, "{err}");
    assert_eq!(tensor.as_deref(), Some("b"));
    assert!(path.ends_with("model-00002-of-00003.safetensors.partial"));
    assert!(!w.is_written("b"), "a failed write stays pending");
    println!("CHILD-OK: {err}");
}
