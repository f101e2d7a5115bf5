//! The PVH stub kernel (`fixtures/pvh-stub.S`): a few instructions that
//! print, tick and exit, for tests of the VMM process that need no guest OS.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Assembles the PVH stub kernel with the given symbols into `dir`.
pub fn build_stub(dir: &Path, ticks: bool, exit_code: u32, delay: u32) -> PathBuf {
    build_stub_mode(dir, u8::from(ticks), exit_code, delay)
}

/// [`build_stub`] with the stub's TICKS mode: 0 exit, 1 dots, 2 letters a..z,
/// 3 a triple fault (a crashed guest).
pub fn build_stub_mode(dir: &Path, ticks: u8, exit_code: u32, delay: u32) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pvh-stub.S");
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
