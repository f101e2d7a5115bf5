//! Helpers shared by the integration tests: building test kernels, running
//! kemari, waiting for output.

#![allow(dead_code)]

pub mod scenario;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The kemari binary under test.
pub fn kemari() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kemari"))
}

/// The kemarictl binary under test.
pub fn kemarictl(socket: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kemarictl"));
    c.arg("--api-socket").arg(socket);
    c
}

/// Whether /dev/kvm can be used; tests that boot VMs skip (loudly) without it.
pub fn have_kvm() -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        eprintln!("SKIP: /dev/kvm is not usable here");
    }
    ok
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kemari-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Assembles the PVH stub kernel with the given symbols into `dir`.
pub fn build_stub(dir: &Path, ticks: bool, exit_code: u32, delay: u32) -> PathBuf {
    build_stub_mode(dir, u8::from(ticks), exit_code, delay)
}

/// [`build_stub`] with the stub's TICKS mode: 0 exit, 1 dots, 2 letters a..z.
#[allow(dead_code)]
pub fn build_stub_mode(dir: &Path, ticks: u8, exit_code: u32, delay: u32) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pvh-stub.S");
    let obj = dir.join("stub.o");
    let elf = dir.join(format!("stub-{ticks}-{exit_code}.elf"));
    let st = Command::new("as")
        .args(["--64", "--defsym"])
        .arg(format!("TICKS={ticks}"))
        .arg("--defsym")
        .arg(format!("EXITCODE={exit_code}"))
        .arg("--defsym")
        .arg(format!("DELAY={delay}"))
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .status()
        .expect("GNU as (binutils) must be installed");
    assert!(st.success(), "assembling the stub failed");
    let st = Command::new("ld")
        .args(["-m", "elf_x86_64", "-Ttext=0x100000", "-e", "_start"])
        .arg(&obj)
        .arg("-o")
        .arg(&elf)
        .status()
        .expect("ld (binutils) must be installed");
    assert!(st.success(), "linking the stub failed");
    elf
}

/// Runs a command to completion with a timeout, killing it if it hangs.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "command timed out after {timeout:?}; stdout: {} stderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `cond` holds, polling; panics with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
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

/// A child process killed on drop.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Builds the guest once per test binary and returns the ELF's path.
pub fn guest_elf() -> PathBuf {
    static ELF: OnceLock<PathBuf> = OnceLock::new();
    static BUILD: Mutex<()> = Mutex::new(());
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    ELF.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(&root)
            .args([
                "build",
                "-p",
                "guest",
                "--target",
                "x86_64-unknown-none",
                "--release",
            ])
            .status()
            .expect("running cargo to build the test guest");
        assert!(
            status.success(),
            "building the test guest failed (is the target installed? \
             `rustup target add x86_64-unknown-none`)"
        );
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        target.join("x86_64-unknown-none/release/guest")
    })
    .clone()
}
