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
/// logs are what one reads after a failure).
pub fn scratch(name: &str) -> PathBuf {
    fresh(format!("kemari-test-{}-{name}", std::process::id()))
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
