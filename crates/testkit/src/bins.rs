//! The binaries under test, and the test guest.
//!
//! **How `kemari` and `kemarictl` are found.** Beside the test executable:
//! cargo builds an integration test as `target/<profile>/deps/<test>-<hash>`
//! and the package's binaries as `target/<profile>/<name>` (the paths its
//! `CARGO_BIN_EXE_<name>` gives), and it builds a package's binaries before
//! it runs that package's integration tests, so the kemari package's tests
//! always find the `kemari` of the same build, whatever the profile, target
//! triple or `CARGO_TARGET_DIR`. `kemari`'s test `testkit_finds_the_binaries_cargo_built`
//! checks that this is the path cargo gives. Where the layout differs (another
//! test runner, a `build-dir` set apart), `KEMARI_TEST_BIN_DIR` names the
//! folder. A test of another package must have them built first
//! (`cargo build -p kemari`); a missing binary is a clear panic, never a
//! stale one found elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Overrides the folder the binaries are taken from.
pub const BIN_DIR_VAR: &str = "KEMARI_TEST_BIN_DIR";

/// The folder holding the binaries of the build the test belongs to.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os(BIN_DIR_VAR) {
            return PathBuf::from(dir);
        }
        let exe = std::env::current_exe().expect("the test executable's path");
        let dir = exe.parent().expect("the test executable's folder");
        if dir.file_name().is_some_and(|n| n == "deps") {
            dir.parent().unwrap_or(dir).to_path_buf()
        } else {
            dir.to_path_buf()
        }
    })
    .clone()
}

/// The binary `name` of this build; panics, saying where it looked, if absent.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "no {name} at {} (build it first, e.g. `cargo build -p kemari`, \
         or name its folder in {BIN_DIR_VAR})",
        path.display()
    );
    path
}

/// The kemari binary under test.
pub fn kemari() -> Command {
    Command::new(bin("kemari"))
}

/// The kemarictl binary under test, talking to `socket`.
pub fn kemarictl(socket: &Path) -> Command {
    let mut c = Command::new(bin("kemarictl"));
    c.arg("--api-socket").arg(socket);
    c
}

/// The workspace's root folder.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// cargo's target folder for the workspace.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Runs `cargo build ARGS` in the workspace; panics with `failed` if it fails.
fn cargo_build(args: &[&str], failed: &str) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(workspace_root())
        .arg("build")
        .args(args)
        .status()
        .expect("running cargo");
    assert!(status.success(), "{failed}");
}

/// Builds `package`'s debug binary `name` once per test binary and returns
/// its path (a binary of another package than the test's, e.g. kemari-nbd).
pub fn built_debug_bin(package: &'static str, name: &'static str) -> PathBuf {
    static BUILT: Mutex<Vec<(&str, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| *n == name) {
        return path.clone();
    }
    cargo_build(&["-p", package], &format!("building {package} failed"));
    let path = target_dir().join("debug").join(name);
    built.push((name, path.clone()));
    path
}

/// Builds the guest once per test binary and returns the ELF's path.
pub fn guest_elf() -> PathBuf {
    static ELF: OnceLock<PathBuf> = OnceLock::new();
    static BUILD: Mutex<()> = Mutex::new(());
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    ELF.get_or_init(|| {
        cargo_build(
            &[
                "-p",
                "guest",
                "--target",
                "x86_64-unknown-none",
                "--release",
            ],
            "building the test guest failed (is the target installed? \
             `rustup target add x86_64-unknown-none`)",
        );
        target_dir().join("x86_64-unknown-none/release/guest")
    })
    .clone()
}
