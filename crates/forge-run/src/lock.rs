//! An exclusive lock on an output directory, so that two runs never write the
//! same `OUT_DIR` at once (their shards, manifest and index would interleave).
//!
//! The lock is an OS advisory lock (`flock` on Unix, `LockFileEx` on Windows,
//! through [`std::fs::File::try_lock`]) on the file [`LOCK_FILE`] inside the
//! directory. The OS drops it when the process dies, so a killed run never
//! leaves a stale lock behind; the file holds the owner's pid for the message.
//! The file is removed on [`Drop`] (while still locked); `acquire` re-checks
//! that the file it locked is still the one at the path, so a run racing with
//! that removal retries instead of locking an unlinked file.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Name of the lock file inside `OUT_DIR`. The run's emptiness check and
/// `--overwrite` must ignore (and not remove) it: see [`is_lock_file`].
pub const LOCK_FILE: &str = "forge.lock";

/// Whether `path` is an output directory's lock file.
pub fn is_lock_file(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == LOCK_FILE)
}

/// Holds the exclusive lock on an output directory until dropped.
#[derive(Debug)]
pub struct OutDirLock {
    file: File,
    path: PathBuf,
}

impl OutDirLock {
    /// Takes the lock on `out_dir` (which must exist), without waiting.
    ///
    /// Fails with [`Error::OutDir`] "another forge run is writing here (pid N)"
    /// when another process (or another `OutDirLock` in this one) holds it.
    pub fn acquire(out_dir: &Path) -> Result<OutDirLock> {
        let path = out_dir.join(LOCK_FILE);
        for _ in 0..16 {
            if let Ok(m) = std::fs::symlink_metadata(&path) {
                if !m.file_type().is_file() {
                    return Err(Error::OutDir {
                        dir: out_dir.into(),
                        reason: format!("{LOCK_FILE} exists and is not a regular file; remove it"),
                    });
                }
            }
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(Error::io("create lock file", &path))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    let mut text = String::new();
                    // Best effort: the owner may not have written its pid yet.
                    let _ = (&file).take(64).read_to_string(&mut text);
                    let pid = text.trim();
                    let who = if pid.is_empty() {
                        String::from("pid unknown")
                    } else {
                        format!("pid {pid}")
                    };
                    return Err(Error::OutDir {
                        dir: out_dir.into(),
                        reason: format!(
                            "another forge run is writing here ({who}); wait for it to finish or stop it"
                        ),
                    });
                }
                Err(TryLockError::Error(e)) => return Err(Error::io("lock", &path)(e)),
            }
            if !same_file(&file, &path) {
                // The previous owner removed the file between our open and our lock.
                continue;
            }
            let pid = std::process::id();
            file.set_len(0)
                .and_then(|()| file.seek(SeekFrom::Start(0)))
                .and_then(|_| writeln!(file, "{pid}"))
                .map_err(Error::io("write lock file", &path))?;
            return Ok(OutDirLock { file, path });
        }
        Err(Error::OutDir {
            dir: out_dir.into(),
            reason: format!("could not lock {LOCK_FILE}: it keeps being replaced"),
        })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(unix)]
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_file(_file: &File, path: &Path) -> bool {
    path.is_file()
}

impl Drop for OutDirLock {
    fn drop(&mut self) {
        // Remove while still holding the lock; the OS releases it when `file` closes.
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn second_acquire_fails_and_names_the_owner() {
        let dir = tempfile::tempdir().unwrap();
        let a = OutDirLock::acquire(dir.path()).unwrap();
        assert!(a.path().is_file());
        let e = OutDirLock::acquire(dir.path()).expect_err("second lock must fail");
        let msg = e.to_string();
        let want = format!(
            "another forge run is writing here (pid {})",
            std::process::id()
        );
        assert!(msg.contains(&want), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        drop(a);
        assert!(!dir.path().join(LOCK_FILE).exists());
        let b = OutDirLock::acquire(dir.path()).unwrap();
        drop(b);
    }

    #[test]
    fn stale_lock_file_without_owner_is_taken_over() {
        // A killed run leaves the file but not the OS lock.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "999999\n").unwrap();
        let a = OutDirLock::acquire(dir.path()).unwrap();
        let text = std::fs::read_to_string(a.path()).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
    }

    #[test]
    fn non_regular_lock_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(LOCK_FILE)).unwrap();
        let e = OutDirLock::acquire(dir.path()).expect_err("directory is not a lock file");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(is_lock_file(&dir.path().join(LOCK_FILE)));
    }
}
