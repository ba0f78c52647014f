//! Reading: [`Checkpoint`] and [`TensorView`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use serde::Deserialize;

use crate::dtype::decode_into;
use crate::header::{self, Entries};
use crate::{Dtype, Error, Result, INDEX_FILE};

pub use forge_core::dtype::FP8_BLOCK;

/// A borrowed, zero-copy view of one tensor inside a memory-mapped shard.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major, outermost first).
    pub shape: &'a [usize],
    /// The tensor's little-endian bytes, sliced from the mmap (not aligned).
    pub bytes: &'a [u8],
    /// The shard file holding it.
    pub file: &'a Path,
}

impl TensorView<'_> {
    /// Number of elements (1 for a scalar of shape `[]`).
    pub fn numel(&self) -> usize {
        // The header check proved `numel × size == bytes.len()` without overflow.
        self.bytes.len() / self.dtype.size()
    }

    /// Converts F64/F32/F16/BF16/F8_E4M3/F8_E5M2 to `f32` (F64 rounds).
    /// Integer and boolean dtypes are an error.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.numel()];
        if decode_into(self.dtype, self.bytes, &mut out) {
            Ok(out)
        } else {
            Err(Error::UnsupportedDtype {
                file: self.file.into(),
                tensor: self.name.into(),
                dtype: self.dtype,
                op: "to_f32",
            })
        }
    }
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    metadata: BTreeMap<String, String>,
}

struct Slot {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range in the shard's mmap.
    range: std::ops::Range<usize>,
}

/// A validated, memory-mapped safetensors checkpoint (one file or an indexed
/// set of shards). Reading a tensor touches only its pages.
pub struct Checkpoint {
    root: PathBuf,
    shards: Vec<Shard>,
    /// Shards in file-name order, tensors in offset order within a shard.
    slots: Vec<Slot>,
    by_name: HashMap<String, usize>,
    layer_prefix: Option<String>,
    layers: BTreeMap<usize, Vec<usize>>,
    non_layer: Vec<usize>,
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: Entries,
}

impl Checkpoint {
    /// Opens a checkpoint: a directory holding `model.safetensors.index.json`,
    /// else `model.safetensors`, else exactly one `*.safetensors` file; or the
    /// path of a single `.safetensors` file. Every shard is mapped read-only
    /// and its header fully validated; an index must match the shards exactly.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(Error::io("stat", path, None))?;
        if meta.is_file() {
            return Self::build(path, vec![load_shard(path.to_owned())?]);
        }
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return Self::from_index(path, &index);
        }
        let single = path.join("model.safetensors");
        if single.is_file() {
            return Self::build(path, vec![load_shard(single)?]);
        }
        let mut found = Vec::new();
        let mut pickles = Vec::new();
        for entry in std::fs::read_dir(path).map_err(Error::io("list", path, None))? {
            let p = entry.map_err(Error::io("list", path, None))?.path();
            let is = |ext: &str| p.extension().is_some_and(|e| e == ext);
            if is("safetensors") && p.is_file() {
                found.push(p);
            } else if (is("bin") || is("pt") || is("pth")) && p.is_file() {
                pickles.push(p);
            }
        }
        if found.is_empty() && !pickles.is_empty() {
            // Pickles can run code when loaded: they are never opened here.
            pickles.sort();
            let name = pickles[0]
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let dir = path.display();
            return Err(Error::NoCheckpoint {
                path: path.into(),
                reason: format!(
                    "it holds only PyTorch pickle weights ({name}, {} file(s)), which forge never loads (unpickling can run code); convert them once to safetensors with transformers, e.g. python -c \"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{dir}', torch_dtype='auto').save_pretrained('{dir}-safetensors', safe_serialization=True)\" (then copy the tokenizer files), and quantize {dir}-safetensors",
                    pickles.len()
                ),
            });
        }
        match <[PathBuf; 1]>::try_from(found) {
            Ok([one]) => Self::build(path, vec![load_shard(one)?]),
            Err(found) => Err(Error::NoCheckpoint {
                path: path.into(),
                reason: format!(
                    "{} .safetensors files and no {INDEX_FILE} (need an index, model.safetensors, or exactly one file)",
                    found.len()
                ),
            }),
        }
    }

    fn from_index(root: &Path, index: &Path) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidIndex {
            file: index.into(),
            reason,
        };
        let text = std::fs::read_to_string(index).map_err(Error::io("read", index, None))?;
        let parsed: IndexFile = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let mut weight_map: HashMap<String, String> = HashMap::new();
        for (tensor, value) in parsed.weight_map.0 {
            let Some(file) = value.as_str() else {
                return Err(invalid(format!("weight_map[{tensor:?}] is not a string")));
            };
            let p = Path::new(file);
            if file.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
                return Err(invalid(format!(
                    "weight_map[{tensor:?}] = {file:?} is not a relative file name"
                )));
            }
            if weight_map.insert(tensor.clone(), file.to_owned()).is_some() {
                return Err(Error::Duplicate {
                    tensor,
                    first: index.into(),
                    second: index.into(),
                });
            }
        }
        // First tensor (by name) mapped to each shard, for error messages.
        let mut files: BTreeMap<&str, &str> = BTreeMap::new();
        for (tensor, file) in &weight_map {
            let first = files.entry(file).or_insert(tensor);
            *first = (*first).min(tensor.as_str());
        }
        let mut shards = Vec::with_capacity(files.len());
        for (file, tensor) in &files {
            let shard = root.join(file);
            if !shard.is_file() {
                return Err(Error::MissingShard {
                    index: index.into(),
                    tensor: (*tensor).into(),
                    shard,
                });
            }
            shards.push(load_shard(shard)?);
        }
        let ckpt = Self::build(root, shards)?;
        // Every stored tensor is mapped to its own shard ...
        for slot in &ckpt.slots {
            let path = &ckpt.shards[slot.shard].path;
            if weight_map
                .get(&slot.name)
                .is_none_or(|f| root.join(f) != *path)
            {
                return Err(Error::Unindexed {
                    index: index.into(),
                    tensor: slot.name.clone(),
                    shard: path.clone(),
                });
            }
        }
        // ... and every indexed tensor is stored (sorted, for a stable error).
        let mut mapped: Vec<(&String, &String)> = weight_map.iter().collect();
        mapped.sort();
        for (tensor, file) in mapped {
            if !ckpt.by_name.contains_key(tensor) {
                return Err(Error::NotInShard {
                    index: index.into(),
                    tensor: tensor.clone(),
                    shard: root.join(file),
                });
            }
        }
        Ok(ckpt)
    }

    fn build(root: &Path, loaded: Vec<(Shard, Vec<header::Entry>)>) -> Result<Self> {
        let mut shards: Vec<Shard> = Vec::with_capacity(loaded.len());
        let mut slots: Vec<Slot> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (shard_idx, (shard, entries)) in loaded.into_iter().enumerate() {
            for e in entries {
                if let Some(&prev) = by_name.get(&e.name) {
                    let first = &shards[slots[prev].shard];
                    return Err(Error::Duplicate {
                        tensor: e.name,
                        first: first.path.clone(),
                        second: shard.path,
                    });
                }
                by_name.insert(e.name.clone(), slots.len());
                slots.push(Slot {
                    name: e.name,
                    dtype: e.dtype,
                    shape: e.shape,
                    shard: shard_idx,
                    range: e.range,
                });
            }
            shards.push(shard);
        }
        let (layer_prefix, layers, non_layer) = group_layers(&slots);
        Ok(Checkpoint {
            root: root.into(),
            shards,
            slots,
            by_name,
            layer_prefix,
            layers,
            non_layer,
        })
    }

    /// Drops the named tensors' pages from this process's resident set; they are re-read
    /// from the file if touched again. A streaming run calls it after each layer so that
    /// resident memory stays at about one layer even though every shard is mapped.
    /// Unknown names are ignored; so is a failing `madvise` (it is only a hint here).
    pub fn release<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        for name in names {
            let Some(&i) = self.by_name.get(name) else {
                continue;
            };
            let s = &self.slots[i];
            if s.range.is_empty() {
                continue;
            }
            // SAFETY: the map is read-only and file-backed: MADV_DONTNEED only drops pages,
            // which the kernel re-reads from the file on the next access (same bytes).
            let _ = unsafe {
                self.shards[s.shard].mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    s.range.start,
                    s.range.len(),
                )
            };
        }
    }

    /// Asks the kernel to read the named tensors' pages ahead (`MADV_WILLNEED`), so that a
    /// layer's bytes come from the page cache by the time it is processed. It may block while
    /// the reads are queued: call it off the critical path (see `Session::prefetch`). Unknown
    /// names are ignored; so is a failing `madvise` (it is only a hint).
    pub fn prefetch<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        for name in names {
            let Some(&i) = self.by_name.get(name) else {
                continue;
            };
            let s = &self.slots[i];
            if !s.range.is_empty() {
                let _ = self.shards[s.shard].mmap.advise_range(
                    memmap2::Advice::WillNeed,
                    s.range.start,
                    s.range.len(),
                );
            }
        }
    }

    fn view(&self, i: usize) -> TensorView<'_> {
        let s = &self.slots[i];
        let shard = &self.shards[s.shard];
        TensorView {
            name: &s.name,
            dtype: s.dtype,
            shape: &s.shape,
            bytes: &shard.mmap[s.range.clone()],
            file: &shard.path,
        }
    }

    /// The path the checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The shard files, in file-name order.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// The `__metadata__` of the first shard (empty if absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        static EMPTY: BTreeMap<String, String> = BTreeMap::new();
        self.shards.first().map_or(&EMPTY, |s| &s.metadata)
    }

    /// The named tensor, or `None`.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name.get(name).map(|&i| self.view(i))
    }

    /// The named tensor, or [`Error::NotFound`].
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name).ok_or_else(|| Error::NotFound {
            checkpoint: self.root.clone(),
            tensor: name.into(),
        })
    }

    /// Tensor names in storage order: shards by file name, then by offset.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// All tensors, in the order of [`Checkpoint::names`].
    pub fn iter(&self) -> impl Iterator<Item = TensorView<'_>> {
        (0..self.slots.len()).map(|i| self.view(i))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Sum of all tensors' byte sizes.
    pub fn total_bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.range.len() as u64).sum()
    }

    /// Checks, from the headers alone, that the `F8_E4M3` tensor `name` is a
    /// 2-D weight `[N, K]` with a floating-point sibling `name_scale_inv` of
    /// shape `[ceil(N/128), ceil(K/128)]` (what [`Checkpoint::dequantized_f32`]
    /// needs); returns the scale and `[N, K]`.
    pub fn fp8_scale(&self, name: &str) -> Result<(TensorView<'_>, [usize; 2])> {
        let w = self.tensor(name)?;
        let scale_name = format!("{name}_scale_inv");
        let fail = |expected: String, actual: String| Error::Fp8Scale {
            file: w.file.into(),
            weight: name.into(),
            scale: scale_name.clone(),
            expected,
            actual,
        };
        let Some(s) = self.get(&scale_name) else {
            return Err(fail("a scale tensor of that name".into(), "none".into()));
        };
        let &[n, k] = w.shape else {
            return Err(fail("a 2-D weight".into(), format!("shape {:?}", w.shape)));
        };
        let expected = [n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK)];
        if s.shape != expected {
            return Err(fail(
                format!("scale shape {expected:?} for weight shape {:?}", w.shape),
                format!("{:?}", s.shape),
            ));
        }
        if !s.dtype.is_float() {
            return Err(fail(
                "a floating-point scale".into(),
                format!("dtype {}", s.dtype.name()),
            ));
        }
        Ok((s, [n, k]))
    }

    /// The tensor as `f32`. An `F8_E4M3` tensor `X` must have a sibling
    /// `X_scale_inv` (e.g. `X.weight_scale_inv`) of shape
    /// `[ceil(N/128), ceil(K/128)]` for its `[N, K]` shape; the result is
    /// `W[n, k] = fp8[n, k] · scale_inv[n / 128, k / 128]`, row-major.
    /// Other float dtypes are converted as [`TensorView::to_f32`] does.
    pub fn dequantized_f32(&self, name: &str) -> Result<Vec<f32>> {
        let w = self.tensor(name)?;
        if w.dtype != Dtype::F8_E4M3 {
            return w.to_f32();
        }
        let (s, [n, k]) = self.fp8_scale(name)?;
        // fp8_scale checked the scale's shape against [n, k]; a mismatch is reported anyway.
        forge_core::dtype::dequantize_fp8_blocks(w.bytes, &s.to_f32()?, n, k).map_err(|e| {
            Error::Fp8Scale {
                file: w.file.into(),
                weight: name.into(),
                scale: format!("{name}_scale_inv"),
                expected: "a scale and weight of matching shapes".into(),
                actual: e.to_string(),
            }
        })
    }

    /// The prefix before `layers.<i>.` of the decoder stack (e.g. `model.` or
    /// `model.language_model.`); `None` if no tensor name has that form.
    ///
    /// With several prefixes (a vision tower next to the language model), the
    /// one containing `language_model` wins, else the one with most tensors.
    pub fn layer_prefix(&self) -> Option<&str> {
        self.layer_prefix.as_deref()
    }

    /// Indices of the decoder layers, ascending (MTP layers included).
    pub fn layers(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// Names of the tensors of decoder layer `i`, in storage order (empty if none).
    pub fn layer_tensors(&self, i: usize) -> Vec<&str> {
        self.layers.get(&i).map_or_else(Vec::new, |v| {
            v.iter().map(|&j| self.slots[j].name.as_str()).collect()
        })
    }

    /// Names of all tensors outside the decoder layers (embeddings, final
    /// norm, `lm_head`, other towers), in storage order.
    pub fn non_layer_tensors(&self) -> Vec<&str> {
        self.non_layer
            .iter()
            .map(|&j| self.slots[j].name.as_str())
            .collect()
    }
}

fn load_shard(path: PathBuf) -> Result<(Shard, Vec<header::Entry>)> {
    let file = File::open(&path).map_err(Error::io("open", &path, None))?;
    let len = file
        .metadata()
        .map_err(Error::io("stat", &path, None))?
        .len();
    if len < 8 {
        return Err(Error::Truncated { file: path, len });
    }
    // SAFETY: the map is read-only and private to this process. Like every
    // mmap-based reader, we rely on the checkpoint not being truncated or
    // rewritten by another process while it is open.
    let mmap = unsafe { Mmap::map(&file) }.map_err(Error::io("mmap", &path, None))?;
    let header = header::parse(&path, &mmap)?;
    Ok((
        Shard {
            path,
            mmap,
            metadata: header.metadata,
        },
        header.entries,
    ))
}

/// Splits `<prefix>layers.<i>.<rest>` into `(prefix, i)`; the `layers` segment
/// must start the name or follow a dot.
pub fn split_layer_name(name: &str) -> Option<(&str, usize)> {
    const KEY: &str = "layers.";
    let mut from = 0;
    while let Some(pos) = name.get(from..).and_then(|s| s.find(KEY)) {
        let start = from + pos;
        let after = start + KEY.len();
        let rest = name.get(after..).unwrap_or_default();
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let at_boundary = start == 0 || name.as_bytes().get(start - 1) == Some(&b'.');
        if at_boundary && digits > 0 && rest.as_bytes().get(digits) == Some(&b'.') {
            if let Ok(i) = rest[..digits].parse() {
                return Some((&name[..start], i));
            }
        }
        from = after;
    }
    None
}

type Grouping = (Option<String>, BTreeMap<usize, Vec<usize>>, Vec<usize>);

fn group_layers(slots: &[Slot]) -> Grouping {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for s in slots {
        if let Some((p, _)) = split_layer_name(&s.name) {
            *counts.entry(p).or_default() += 1;
        }
    }
    let prefix = counts
        .iter()
        .max_by_key(|(p, &n)| (p.contains("language_model"), n, std::cmp::Reverse(*p)))
        .map(|(p, _)| (*p).to_owned());
    let mut layers: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut rest = Vec::new();
    for (j, s) in slots.iter().enumerate() {
        match split_layer_name(&s.name) {
            Some((p, i)) if Some(p) == prefix.as_deref() => layers.entry(i).or_default().push(j),
            _ => rest.push(j),
        }
    }
    (prefix, layers, rest)
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.root)
            .field("shards", &self.shards.len())
            .field("tensors", &self.slots.len())
            .finish()
    }
}
