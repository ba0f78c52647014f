//! Validating parser for one safetensors header.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use crate::{Dtype, Error, Result, MAX_HEADER_BYTES};

/// A JSON object read as `(key, value)` pairs in file order, so that a key
/// written twice is seen (serde_json's maps keep only the last).
pub(crate) struct Entries(pub Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(kv) = map.next_entry()? {
                    v.push(kv);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(serde::Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// One validated tensor entry.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// `data_offsets`, relative to the data area.
    pub begin: u64,
    pub end: u64,
    /// The same range as absolute indices into the file buffer.
    pub range: std::ops::Range<usize>,
}

/// A validated header.
pub(crate) struct Header {
    /// `__metadata__`, if any.
    pub metadata: BTreeMap<String, String>,
    /// Tensors sorted by `begin`.
    pub entries: Vec<Entry>,
}

/// `numel × size` with overflow checks; `None` on overflow.
pub(crate) fn byte_size(shape: &[u64], dtype: Dtype) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))?
        .checked_mul(dtype.size() as u64)
}

/// Parses and validates the header of the safetensors file `file` whose
/// full contents are `buf`.
pub(crate) fn parse(file: &Path, buf: &[u8]) -> Result<Header> {
    let file_len = buf.len() as u64;
    let Some(prefix) = buf.first_chunk::<8>() else {
        return Err(Error::Truncated {
            file: file.into(),
            len: file_len,
        });
    };
    let header_len = u64::from_le_bytes(*prefix);
    if header_len > MAX_HEADER_BYTES {
        return Err(Error::HeaderTooLarge {
            file: file.into(),
            header_len,
            max: MAX_HEADER_BYTES,
        });
    }
    let data_start =
        header_len
            .checked_add(8)
            .filter(|&e| e <= file_len)
            .ok_or(Error::HeaderPastEof {
                file: file.into(),
                header_len,
                file_len,
            })?;
    let data_len = file_len - data_start;
    let invalid = |reason: String| Error::InvalidHeader {
        file: file.into(),
        reason,
    };
    // `data_start <= file_len == buf.len()`, so the range is in bounds.
    let text = std::str::from_utf8(&buf[8..data_start as usize])
        .map_err(|e| invalid(format!("not UTF-8: {e}")))?;
    let Entries(raw) =
        serde_json::from_str(text).map_err(|e| invalid(format!("not a JSON object: {e}")))?;

    let mut metadata = BTreeMap::new();
    let mut entries: Vec<Entry> = Vec::with_capacity(raw.len());
    let mut seen = std::collections::HashSet::with_capacity(raw.len());
    for (name, value) in raw {
        if !seen.insert(name.clone()) {
            return Err(Error::Duplicate {
                tensor: name,
                first: file.into(),
                second: file.into(),
            });
        }
        let bad_entry = |reason: String| Error::InvalidEntry {
            file: file.into(),
            tensor: name.clone(),
            reason,
        };
        if name == "__metadata__" {
            metadata = serde_json::from_value(value)
                .map_err(|e| bad_entry(format!("must map strings to strings: {e}")))?;
            continue;
        }
        let info: RawInfo = serde_json::from_value(value).map_err(|e| bad_entry(e.to_string()))?;
        let Some(dtype) = Dtype::from_name(&info.dtype) else {
            return Err(Error::UnknownDtype {
                file: file.into(),
                tensor: name,
                dtype: info.dtype,
            });
        };
        let (begin, end) = info.data_offsets;
        if begin > end || end > data_len {
            return Err(Error::InvalidOffsets {
                file: file.into(),
                tensor: name,
                begin,
                end,
                data_len,
            });
        }
        let overflow = || Error::SizeOverflow {
            file: file.into(),
            tensor: name.clone(),
            shape: info.shape.clone(),
        };
        let expected = byte_size(&info.shape, dtype).ok_or_else(overflow)?;
        let shape = info
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| overflow())?;
        if expected != end - begin {
            return Err(Error::SizeMismatch {
                file: file.into(),
                tensor: name,
                dtype,
                shape,
                expected,
                actual: end - begin,
            });
        }
        // `data_start + end <= file_len == buf.len()`: both fit in usize.
        let range = (data_start + begin) as usize..(data_start + end) as usize;
        entries.push(Entry {
            name,
            dtype,
            shape,
            begin,
            end,
            range,
        });
    }

    // Overlap check: sorted by start, every non-empty range must begin at or
    // after the furthest end seen so far. Gaps are tolerated.
    entries.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut furthest: Option<&Entry> = None;
    for e in entries.iter().filter(|e| e.end > e.begin) {
        if let Some(f) = furthest {
            if e.begin < f.end {
                return Err(Error::Overlap {
                    file: file.into(),
                    first: f.name.clone(),
                    first_begin: f.begin,
                    first_end: f.end,
                    second: e.name.clone(),
                    second_begin: e.begin,
                });
            }
        }
        if furthest.is_none_or(|f| e.end > f.end) {
            furthest = Some(e);
        }
    }
    Ok(Header { metadata, entries })
}
