//! Scratch folders and reading files that may not exist yet.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::net::free_port;

/// `name` as a fresh (emptied) folder under the temporary folder.
fn fresh(name: String) -> PathBuf {
    let d = std::env::temp_dir().join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating a scratch folder");
    d
}

/// A fresh scratch directory for one test, kept afterwards (its consoles and
/// logs are what one reads after a failure) — until a later test run: the
/// scratch directories of test processes that no longer live are removed
/// first (some hold disk images of hundreds of MiB, and CI runs again and
/// again on one machine).
pub fn scratch(name: &str) -> PathBuf {
    remove_scratch_of_ended_runs();
    fresh(format!("kemari-test-{}-{name}", std::process::id()))
}

/// Removes `kemari-test-<pid>-*` directories whose process has ended.
fn remove_scratch_of_ended_runs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let tmp = std::env::temp_dir();
        let Ok(entries) = std::fs::read_dir(&tmp) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("kemari-test-")
                .and_then(|rest| rest.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
}

/// A fresh scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        TempDir(fresh(format!(
            "knbd-it-{tag}-{}-{}",
            std::process::id(),
            free_port()
        )))
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Reads a file to a string ("" if absent).
pub fn read_text(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// Waits up to 10 s until the log file at `path` holds `needle`, then
/// checks that it holds no terminal escape (colour) codes and returns it.
pub fn log_without_escapes(path: &Path, needle: &str) -> String {
    crate::procs::wait_for(
        &format!("{needle:?} in {}", path.display()),
        std::time::Duration::from_secs(10),
        || read_text(path).contains(needle),
    );
    let text = read_text(path);
    assert!(
        !text.contains('\x1b'),
        "escape codes in the log file {}: {text:?}",
        path.display()
    );
    text
}

/// The pre-shared key of the tests' migration and FT links.
pub const TEST_KEY: &str = "kemari-test-key-0123456789abcdef";

/// Writes [`TEST_KEY`] to `DIR/key` (0600) and returns its path.
pub fn test_key(dir: &Path) -> PathBuf {
    let path = dir.join("key");
    write_key(&path, TEST_KEY);
    path
}

/// Writes a pre-shared key file as kemari wants it: readable by its owner
/// only (0600).
pub fn write_key(path: &Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(text.as_bytes()).unwrap();
}
