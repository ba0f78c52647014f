//! Writing: [`ShardPlan`] and [`ShardWriter`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use serde_json::{json, Value};

use crate::header::byte_size;
use crate::{Dtype, Error, Result, INDEX_FILE, MAX_HEADER_BYTES};

/// Hugging Face's default shard size limit, "5GB" (tensor bytes per shard).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Suffix of files that are still being written.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// Name, dtype and shape of one tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Builds a spec.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: impl Into<Vec<usize>>) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.into(),
        }
    }
}

/// One tensor's place in a planned shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    /// What it is.
    pub spec: TensorSpec,
    /// Start of its bytes, relative to the shard's data area.
    pub offset: u64,
    /// Its byte length (`numel × dtype size`).
    pub len: u64,
}

/// One planned output file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedShard {
    /// `model-0000i-of-0000N.safetensors`.
    pub file_name: String,
    /// Its tensors in data order (by descending dtype size, then plan order,
    /// so every tensor is aligned to its element size).
    pub tensors: Vec<PlannedTensor>,
    /// Length of the data area (sum of `len`).
    pub data_len: u64,
}

/// The layout of a sharded checkpoint, fixed before any byte is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    shards: Vec<PlannedShard>,
    total_bytes: u64,
}

impl ShardPlan {
    /// Packs `specs` greedily, in the given order, into shards of at most
    /// `max_shard_bytes` tensor bytes; a tensor larger than the limit gets a
    /// shard of its own. Names must be unique and the list non-empty.
    pub fn new(specs: impl IntoIterator<Item = TensorSpec>, max_shard_bytes: u64) -> Result<Self> {
        let invalid = |tensor: &str, reason: &str| Error::InvalidPlan {
            tensor: tensor.into(),
            reason: reason.into(),
        };
        if max_shard_bytes == 0 {
            return Err(invalid("", "max_shard_bytes must be positive"));
        }
        let mut groups: Vec<Vec<(TensorSpec, u64)>> = Vec::new();
        let mut current_bytes = 0u64;
        let mut total_bytes = 0u64;
        let mut seen = HashSet::new();
        for spec in specs {
            if spec.name == "__metadata__" {
                return Err(invalid(&spec.name, "reserved name"));
            }
            if !seen.insert(spec.name.clone()) {
                return Err(invalid(&spec.name, "listed twice"));
            }
            let shape: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
            let len = byte_size(&shape, spec.dtype)
                .ok_or_else(|| invalid(&spec.name, "byte size overflows"))?;
            total_bytes = total_bytes
                .checked_add(len)
                .ok_or_else(|| invalid(&spec.name, "total size overflows"))?;
            match groups.last_mut() {
                Some(g)
                    if current_bytes
                        .checked_add(len)
                        .is_some_and(|t| t <= max_shard_bytes) =>
                {
                    current_bytes += len;
                    g.push((spec, len));
                }
                _ => {
                    current_bytes = len;
                    groups.push(vec![(spec, len)]);
                }
            }
        }
        if groups.is_empty() {
            return Err(invalid("", "no tensors"));
        }
        let n = groups.len();
        let shards = groups
            .into_iter()
            .enumerate()
            .map(|(i, mut group)| {
                // Stable: plan order among tensors of equal element size.
                group.sort_by_key(|(s, _)| std::cmp::Reverse(s.dtype.size()));
                let mut offset = 0u64;
                let tensors = group
                    .into_iter()
                    .map(|(spec, len)| {
                        let t = PlannedTensor { spec, offset, len };
                        offset += len; // bounded by total_bytes
                        t
                    })
                    .collect();
                PlannedShard {
                    file_name: format!("model-{:05}-of-{n:05}.safetensors", i + 1),
                    tensors,
                    data_len: offset,
                }
            })
            .collect();
        Ok(ShardPlan {
            shards,
            total_bytes,
        })
    }

    /// The planned shards, in file order.
    pub fn shards(&self) -> &[PlannedShard] {
        &self.shards
    }

    /// Sum of all tensors' byte sizes (the index's `metadata.total_size`).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The shard file a tensor goes to.
    pub fn file_of(&self, name: &str) -> Option<&str> {
        self.shards
            .iter()
            .find(|s| s.tensors.iter().any(|t| t.spec.name == name))
            .map(|s| s.file_name.as_str())
    }

    /// `model.safetensors.index.json` contents: `metadata.total_size` and a
    /// `weight_map` with sorted keys.
    pub fn index_json(&self) -> String {
        let weight_map: BTreeMap<&str, &str> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(|t| (t.spec.name.as_str(), s.file_name.as_str()))
            })
            .collect();
        let index =
            json!({ "metadata": { "total_size": self.total_bytes }, "weight_map": weight_map });
        // Serializing a Value with string keys cannot fail.
        serde_json::to_string_pretty(&index).unwrap_or_default() + "\n"
    }
}

/// Length prefix + JSON header (keys sorted, `__metadata__` included, padded
/// with spaces to a multiple of 8) for one planned shard.
fn header_bytes(shard: &PlannedShard, metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut meta = metadata.clone();
    meta.entry("format".into()).or_insert_with(|| "pt".into());
    let mut header: BTreeMap<&str, Value> = BTreeMap::new();
    header.insert("__metadata__", json!(meta));
    for t in &shard.tensors {
        let value = json!({
            "dtype": t.spec.dtype.name(),
            "shape": t.spec.shape,
            "data_offsets": [t.offset, t.offset + t.len],
        });
        header.insert(&t.spec.name, value);
    }
    let mut text = serde_json::to_vec(&header).map_err(|e| Error::InvalidPlan {
        tensor: String::new(),
        reason: e.to_string(),
    })?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let n = text.len() as u64;
    if n > MAX_HEADER_BYTES {
        return Err(Error::InvalidPlan {
            tensor: String::new(),
            reason: format!(
                "{}: header of {n} bytes exceeds {MAX_HEADER_BYTES}",
                shard.file_name
            ),
        });
    }
    let mut out = Vec::with_capacity(text.len() + 8);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&text);
    Ok(out)
}

const PENDING: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;

struct OpenShard {
    partial: PathBuf,
    final_path: PathBuf,
    file: File,
    reopened: bool,
    /// The file already has its final name (renamed by this or an earlier run).
    published: AtomicBool,
}

struct Target {
    shard: usize,
    /// Absolute file position.
    pos: u64,
    len: u64,
}

/// Writes a [`ShardPlan`] into `<file>.partial` files, tensor by tensor at
/// planned offsets (any order, any thread), then renames them into place.
///
/// `Send + Sync`: share it by reference across threads. Dropping it before
/// [`ShardWriter::finish`] leaves only `.partial` files behind.
pub struct ShardWriter {
    dir: PathBuf,
    plan: ShardPlan,
    shards: Vec<OpenShard>,
    by_name: HashMap<String, usize>,
    targets: Vec<Target>,
    states: Vec<AtomicU8>,
}

impl ShardWriter {
    /// Creates (truncating) every `<file>.partial` in `out_dir` (created if
    /// missing), writes its header and sets its final length.
    pub fn create(
        out_dir: impl AsRef<Path>,
        plan: ShardPlan,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        Self::open(out_dir.as_ref(), plan, metadata, Reuse::No)
    }

    /// Like [`ShardWriter::create`], but a `<file>.partial` that already has
    /// exactly this plan's header bytes and length is reopened without
    /// truncation, so bytes written by an earlier run stay; see
    /// [`ShardWriter::reopened_files`] and [`ShardWriter::mark_written`].
    pub fn create_or_reopen(
        out_dir: impl AsRef<Path>,
        plan: ShardPlan,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        Self::open(out_dir.as_ref(), plan, metadata, Reuse::Partial)
    }

    /// Like [`ShardWriter::create_or_reopen`], for an output whose publication
    /// ([`ShardWriter::publish_shard`]) had begun: a shard without its
    /// `.partial` that already sits under its final name, with exactly this
    /// plan's header bytes and length, is reopened in place (a rename is
    /// atomic and follows an fsync, so a renamed shard is complete).
    pub fn reopen_publishing(
        out_dir: impl AsRef<Path>,
        plan: ShardPlan,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        Self::open(out_dir.as_ref(), plan, metadata, Reuse::PartialOrFinal)
    }

    fn open(
        dir: &Path,
        plan: ShardPlan,
        metadata: &BTreeMap<String, String>,
        reuse: Reuse,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir, None))?;
        let mut shards = Vec::with_capacity(plan.shards.len());
        let mut by_name = HashMap::new();
        let mut targets = Vec::new();
        for (si, planned) in plan.shards.iter().enumerate() {
            let header = header_bytes(planned, metadata)?;
            let data_start = header.len() as u64;
            let partial = dir.join(format!("{}{PARTIAL_SUFFIX}", planned.file_name));
            let overflow = || Error::InvalidPlan {
                tensor: String::new(),
                reason: format!("{}: size overflows", planned.file_name),
            };
            let total = data_start
                .checked_add(planned.data_len)
                .ok_or_else(overflow)?;
            let final_path = dir.join(&planned.file_name);
            let mut published = false;
            let existing = match reuse {
                Reuse::No => None,
                Reuse::Partial => reopen_if_identical(&partial, &header, total)?,
                Reuse::PartialOrFinal => match reopen_if_identical(&partial, &header, total)? {
                    Some(f) => Some(f),
                    None if !partial.exists() => {
                        let f = reopen_if_identical(&final_path, &header, total)?;
                        published = f.is_some();
                        f
                    }
                    None => None,
                },
            };
            let reopened = existing.is_some();
            let file = match existing {
                Some(f) => f,
                None => {
                    let f = File::options()
                        .read(true)
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .open(&partial)
                        .map_err(Error::io("create", &partial, None))?;
                    f.write_all_at(&header, 0).map_err(Error::io(
                        "write header",
                        &partial,
                        None,
                    ))?;
                    f.set_len(total)
                        .map_err(Error::io("set length", &partial, None))?;
                    f
                }
            };
            for t in &planned.tensors {
                by_name.insert(t.spec.name.clone(), targets.len());
                let pos = data_start.checked_add(t.offset).ok_or_else(overflow)?;
                targets.push(Target {
                    shard: si,
                    pos,
                    len: t.len,
                });
            }
            shards.push(OpenShard {
                partial,
                final_path,
                file,
                reopened,
                published: AtomicBool::new(published),
            });
        }
        let states = targets.iter().map(|_| AtomicU8::new(PENDING)).collect();
        Ok(ShardWriter {
            dir: dir.into(),
            plan,
            shards,
            by_name,
            targets,
            states,
        })
    }

    fn lookup(&self, name: &str) -> Result<(usize, &Target, &OpenShard)> {
        let &i = self.by_name.get(name).ok_or_else(|| Error::NotFound {
            checkpoint: self.dir.clone(),
            tensor: name.into(),
        })?;
        let t = &self.targets[i];
        Ok((i, t, &self.shards[t.shard]))
    }

    /// Writes one tensor's bytes at its planned offset. Each tensor must be
    /// written exactly once, with exactly its planned length. On an I/O error
    /// (e.g. `ENOSPC`) the tensor stays unwritten and may be retried.
    pub fn write_tensor(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let (i, t, shard) = self.lookup(name)?;
        if bytes.len() as u64 != t.len {
            return Err(Error::WriteLength {
                file: shard.partial.clone(),
                tensor: name.into(),
                expected: t.len,
                actual: bytes.len() as u64,
            });
        }
        self.states[i]
            .compare_exchange(PENDING, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| Error::AlreadyWritten {
                file: shard.partial.clone(),
                tensor: name.into(),
            })?;
        match shard.file.write_all_at(bytes, t.pos) {
            Ok(()) => {
                self.states[i].store(DONE, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                self.states[i].store(PENDING, Ordering::Release);
                Err(Error::io("write", &shard.partial, Some(name))(e))
            }
        }
    }

    /// Declares that a tensor's bytes are already on disk from an earlier run
    /// (the caller's manifest says so). Only allowed in a reopened shard.
    pub fn mark_written(&self, name: &str) -> Result<()> {
        let (i, _, shard) = self.lookup(name)?;
        if !shard.reopened {
            return Err(Error::NotReopened {
                file: shard.partial.clone(),
                tensor: name.into(),
            });
        }
        self.states[i]
            .compare_exchange(PENDING, DONE, Ordering::AcqRel, Ordering::Acquire)
            .map(drop)
            .map_err(|_| Error::AlreadyWritten {
                file: shard.partial.clone(),
                tensor: name.into(),
            })
    }

    /// Whether the tensor has been written (or marked written).
    pub fn is_written(&self, name: &str) -> bool {
        self.by_name
            .get(name)
            .is_some_and(|&i| self.states[i].load(Ordering::Acquire) == DONE)
    }

    /// Planned tensors not written yet, in plan file/data order.
    pub fn unwritten(&self) -> Vec<&str> {
        self.missing().into_iter().map(|(t, _)| t).collect()
    }

    /// File names of the shards whose `.partial` was reopened intact.
    pub fn reopened_files(&self) -> Vec<&str> {
        self.plan
            .shards
            .iter()
            .zip(&self.shards)
            .filter(|(_, s)| s.reopened)
            .map(|(p, _)| p.file_name.as_str())
            .collect()
    }

    /// The plan being written.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    fn missing(&self) -> Vec<(&str, &str)> {
        self.plan
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |t| (t.spec.name.as_str(), s.file_name.as_str()))
            })
            .filter(|(name, _)| !self.is_written(name))
            .collect()
    }

    /// Checks that every tensor was written.
    pub fn check_complete(&self) -> Result<()> {
        let missing = self.missing();
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::Unwritten {
            dir: self.dir.clone(),
            missing: missing
                .into_iter()
                .map(|(t, f)| (t.to_owned(), f.to_owned()))
                .collect(),
        })
    }

    /// Removes an index left by an earlier output: no index may exist while
    /// shards are being renamed, so a crash leaves a directory that fails to
    /// open instead of a stale index over new shards.
    pub fn remove_stale_index(&self) -> Result<()> {
        let index = self.dir.join(INDEX_FILE);
        match std::fs::remove_file(&index) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io("remove stale", &index, None)(e))
            }
            _ => Ok(()),
        }
    }

    /// Fsyncs shard `i` (plan order), renames its `.partial` into place and
    /// fsyncs the directory; a shard already in place is only fsynced.
    /// Returns its file name. Every tensor must have been written
    /// ([`ShardWriter::check_complete`]).
    pub fn publish_shard(&self, i: usize) -> Result<&str> {
        self.check_complete()?;
        let (Some(s), Some(p)) = (self.shards.get(i), self.plan.shards.get(i)) else {
            return Err(Error::InvalidPlan {
                tensor: String::new(),
                reason: format!("no shard {i} (the plan has {})", self.shards.len()),
            });
        };
        if s.published.load(Ordering::Acquire) {
            s.file
                .sync_all()
                .map_err(Error::io("fsync", &s.final_path, None))?;
            return Ok(&p.file_name);
        }
        s.file
            .sync_all()
            .map_err(Error::io("fsync", &s.partial, None))?;
        std::fs::rename(&s.partial, &s.final_path)
            .map_err(Error::io("rename", &s.partial, None))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(Error::io("fsync directory", &self.dir, None))?;
        s.published.store(true, Ordering::Release);
        Ok(&p.file_name)
    }

    /// A second handle on the shard `file_name` (a planned file name) and its current
    /// path (for errors), to fsync its data without borrowing the writer (e.g. on another
    /// thread, see `forge_run::UnitSync`).
    pub fn sync_handle(&self, file_name: &str) -> Result<(File, PathBuf)> {
        let Some((_, s)) = self
            .plan
            .shards
            .iter()
            .zip(&self.shards)
            .find(|(p, _)| p.file_name == file_name)
        else {
            return Err(Error::InvalidPlan {
                tensor: String::new(),
                reason: format!("{file_name} is not a planned shard"),
            });
        };
        let path = if s.published.load(Ordering::Acquire) {
            &s.final_path
        } else {
            &s.partial
        };
        let file = s
            .file
            .try_clone()
            .map_err(Error::io("duplicate the handle of", path, None))?;
        Ok((file, path.clone()))
    }

    /// File names of the shards already under their final name.
    pub fn published_files(&self) -> Vec<&str> {
        self.plan
            .shards
            .iter()
            .zip(&self.shards)
            .filter(|(_, s)| s.published.load(Ordering::Acquire))
            .map(|(p, _)| p.file_name.as_str())
            .collect()
    }

    /// Writes the index (temp file + rename) and fsyncs the directory. Every
    /// shard must have been published.
    pub fn write_index(self) -> Result<()> {
        if let Some((p, _)) = self
            .plan
            .shards
            .iter()
            .zip(&self.shards)
            .find(|(_, s)| !s.published.load(Ordering::Acquire))
        {
            return Err(Error::InvalidPlan {
                tensor: String::new(),
                reason: format!("{} is not in place yet; no index written", p.file_name),
            });
        }
        let index = self.dir.join(INDEX_FILE);
        let tmp = self.dir.join(format!("{INDEX_FILE}{PARTIAL_SUFFIX}"));
        let f = File::create(&tmp).map_err(Error::io("create", &tmp, None))?;
        f.write_all_at(self.plan.index_json().as_bytes(), 0)
            .map_err(Error::io("write", &tmp, None))?;
        f.sync_all().map_err(Error::io("fsync", &tmp, None))?;
        std::fs::rename(&tmp, &index).map_err(Error::io("rename", &tmp, None))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(Error::io("fsync directory", &self.dir, None))
    }

    /// Checks that every tensor was written, fsyncs and renames each
    /// `.partial` into place, writes the index (temp file + rename) and
    /// fsyncs the directory. On error no further shard is renamed.
    pub fn finish(self) -> Result<()> {
        self.check_complete()?;
        self.remove_stale_index()?;
        for i in 0..self.shards.len() {
            self.publish_shard(i)?;
        }
        self.write_index()
    }
}

#[derive(Clone, Copy)]
enum Reuse {
    No,
    Partial,
    PartialOrFinal,
}

/// Opens `partial` for writing if it exists with exactly `header` at its start
/// and length `total`; `None` if absent or different.
fn reopen_if_identical(partial: &Path, header: &[u8], total: u64) -> Result<Option<File>> {
    let f = match File::options().read(true).write(true).open(partial) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("reopen", partial, None)(e)),
    };
    let len = f
        .metadata()
        .map_err(Error::io("stat", partial, None))?
        .len();
    if len != total {
        return Ok(None);
    }
    let mut existing = vec![0u8; header.len()];
    f.read_exact_at(&mut existing, 0)
        .map_err(Error::io("read header", partial, None))?;
    Ok((existing == header).then_some(f))
}

impl std::fmt::Debug for ShardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardWriter")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("unwritten", &self.missing().len())
            .finish()
    }
}
