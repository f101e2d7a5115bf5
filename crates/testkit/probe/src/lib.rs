//! What the tests of a crate need from the machine, probed when the crate is
//! built, so that a test that cannot run here is reported **ignored, with its
//! reason**, instead of passing having run nothing.
//!
//! A test-owning crate's `build.rs` names what its tests need:
//!
//! ```text
//! fn main() {
//!     kemari_test_probe::probe(&[kemari_test_probe::Need::Kvm, kemari_test_probe::Need::Tap]);
//! }
//! ```
//!
//! For each need that is missing the build script sets a cfg (always
//! declared with `cargo::rustc-check-cfg`), and the tests say what they need:
//!
//! ```text
//! #[test]
//! #[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
//! fn boots() { /* ... */ }
//! ```
//!
//! | need | cfg set when it is missing | probed by |
//! |---|---|---|
//! | [`Need::Kvm`] | `no_kvm`, and with it the two below | `/dev/kvm` opens read-write, API version 12, `KVM_CREATE_VM` works |
//! | | `no_kvm_dirty_ring` | the VM has `KVM_CAP_DIRTY_LOG_RING[_ACQ_REL]` |
//! | | `no_kvm_sync_regs` | the VM has `KVM_CAP_SYNC_REGS` for regs and sregs |
//! | [`Need::Tap`] | `no_tap` | `/dev/net/tun` opens, CAP_NET_ADMIN (root), `ip` on PATH |
//! | [`Need::Tool`]`(name)` | `no_<name>` (`-`, `.` → `_`) | `name` is an executable on PATH |
//! | [`Need::FioNbd`] | `no_fio_nbd` | `fio --enghelp=nbd` describes the engine |
//!
//! Forcing a need off, to see the skips (any value but `0` or empty):
//! `KEMARI_TEST_NO_KVM=1`, `KEMARI_TEST_NO_TAP=1`. The probes run again when
//! one of those changes, when `/dev/kvm` or `/dev/net/tun` appear or go (their
//! `/dev` folder changes), when a tool found changes or one missing may have
//! come (a PATH folder changed), when `USER` changes (sudo), or when
//! `KEMARI_TEST_REPROBE` takes a new value (after a permission change, which
//! none of the others sees). PATH itself is not watched: cargo run from
//! inside a test may see another one, and would rebuild for nothing.
//!
//! Probed at build time because stable Rust's test harness can only skip a
//! test with `#[ignore]`, which is decided when the test is compiled (a
//! harness of our own could decide at run time, at the cost of rewriting
//! every test file). So the tests see the building machine: test binaries
//! built on one machine and run on another keep the first one's verdicts.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Something tests need from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A usable `/dev/kvm` (cfgs `no_kvm`, `no_kvm_dirty_ring`, `no_kvm_sync_regs`).
    Kvm,
    /// TAP devices and bridges made with `ip` (cfg `no_tap`).
    Tap,
    /// An executable on PATH (cfg `no_<name>`).
    Tool(&'static str),
    /// fio with its NBD engine (cfg `no_fio_nbd`).
    FioNbd,
}

/// The environment variables that force a need off.
pub const NO_KVM: &str = "KEMARI_TEST_NO_KVM";
/// See [`NO_KVM`].
pub const NO_TAP: &str = "KEMARI_TEST_NO_TAP";
/// A new value of this variable runs the probes again.
pub const REPROBE: &str = "KEMARI_TEST_REPROBE";

/// Probes `needs` and prints the build script's cargo instructions.
pub fn probe(needs: &[Need]) {
    for line in instructions(needs) {
        println!("{line}");
    }
}

/// The cargo instructions for `needs`: every cfg declared, the missing ones
/// set, and what makes cargo probe again.
pub fn instructions(needs: &[Need]) -> Vec<String> {
    let mut out = vec![
        "cargo::rerun-if-changed=build.rs".to_string(),
        format!("cargo::rerun-if-env-changed={REPROBE}"),
        "cargo::rerun-if-env-changed=USER".to_string(),
    ];
    let mut missing = Vec::new();
    // Tools looked for on PATH: a found one's file is watched, a missing
    // one's PATH folders (for when it is installed).
    let mut tools = Vec::new();
    for need in needs {
        match *need {
            Need::Kvm => {
                out.push(format!("cargo::rerun-if-env-changed={NO_KVM}"));
                out.push(watch_device("/dev/kvm"));
                let kvm = if forced_off(NO_KVM) {
                    None
                } else {
                    probe_kvm()
                };
                let cfgs = ["no_kvm", "no_kvm_dirty_ring", "no_kvm_sync_regs"];
                let have = match kvm {
                    None => [false; 3],
                    Some(caps) => [true, caps.dirty_ring, caps.sync_regs],
                };
                for (cfg, have) in cfgs.into_iter().zip(have) {
                    declare(&mut out, cfg);
                    if !have {
                        missing.push(cfg.to_string());
                    }
                }
            }
            Need::Tap => {
                out.push(format!("cargo::rerun-if-env-changed={NO_TAP}"));
                out.push(watch_device("/dev/net/tun"));
                tools.push("ip");
                declare(&mut out, "no_tap");
                if forced_off(NO_TAP) || !probe_tap() {
                    missing.push("no_tap".into());
                }
            }
            Need::Tool(name) => {
                tools.push(name);
                let cfg = tool_cfg(name);
                declare(&mut out, &cfg);
                if find_on_path(name).is_none() {
                    missing.push(cfg);
                }
            }
            Need::FioNbd => {
                tools.push("fio");
                declare(&mut out, "no_fio_nbd");
                if !probe_fio_nbd() {
                    missing.push("no_fio_nbd".into());
                }
            }
        }
    }
    let mut watched = Vec::new();
    for tool in tools {
        match find_on_path(tool) {
            Some(file) => watched.push(file),
            None => watched.extend(path_dirs()),
        }
    }
    watched.sort();
    watched.dedup();
    for path in watched {
        out.push(format!("cargo::rerun-if-changed={}", path.display()));
    }
    if !missing.is_empty() {
        out.push(format!(
            "cargo::warning=what some tests need is missing here, they are ignored: {}",
            missing.join(", ")
        ));
    }
    for cfg in missing {
        out.push(format!("cargo::rustc-cfg={cfg}"));
    }
    out
}

/// The cfg a missing tool sets: `no_` and its name with `-` and `.` as `_`.
pub fn tool_cfg(name: &str) -> String {
    format!("no_{}", name.replace(['-', '.'], "_"))
}

fn declare(out: &mut Vec<String>, cfg: &str) {
    out.push(format!("cargo::rustc-check-cfg=cfg({cfg})"));
}

fn forced_off(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A device's node while it exists, else its folder (which changes when the
/// node appears): cargo re-probes on either change.
fn watch_device(node: &str) -> String {
    let node = Path::new(node);
    let watched = if node.exists() {
        node
    } else {
        node.parent().unwrap_or(Path::new("/dev"))
    };
    format!("cargo::rerun-if-changed={}", watched.display())
}

/// What the tests use of a KVM that works.
#[derive(Debug, Clone, Copy)]
struct KvmCaps {
    dirty_ring: bool,
    sync_regs: bool,
}

const KVMIO: libc::c_ulong = 0xAE;
/// `_IO(KVMIO, nr)`.
const fn kvm_io(nr: libc::c_ulong) -> libc::c_ulong {
    (KVMIO << 8) | nr
}
const KVM_GET_API_VERSION: libc::c_ulong = kvm_io(0x00);
const KVM_CREATE_VM: libc::c_ulong = kvm_io(0x01);
const KVM_CHECK_EXTENSION: libc::c_ulong = kvm_io(0x03);
const KVM_API_VERSION: libc::c_int = 12;
const KVM_CAP_SYNC_REGS: libc::c_ulong = 74;
const KVM_CAP_DIRTY_LOG_RING: libc::c_ulong = 192;
const KVM_CAP_DIRTY_LOG_RING_ACQ_REL: libc::c_ulong = 223;
/// `KVM_SYNC_X86_REGS | KVM_SYNC_X86_SREGS`, what the vCPU reads back.
const SYNC_REGS_AND_SREGS: libc::c_int = 3;

/// `/dev/kvm` opens read-write and makes a VM; then what that VM offers.
fn probe_kvm() -> Option<KvmCaps> {
    let kvm = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .ok()?;
    // SAFETY: KVM_GET_API_VERSION takes no argument and only returns a number.
    let version = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if version != KVM_API_VERSION {
        return None;
    }
    // SAFETY: KVM_CREATE_VM with machine type 0 returns a new fd or -1; it
    // touches no memory of ours.
    let vm = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0) };
    if vm < 0 {
        return None;
    }
    // SAFETY: `vm` is a fresh fd that nothing else owns.
    let vm = unsafe { OwnedFd::from_raw_fd(vm) };
    let extension = |cap: libc::c_ulong| {
        // SAFETY: KVM_CHECK_EXTENSION takes the capability number by value
        // and returns a number; it touches no memory of ours.
        unsafe { libc::ioctl(vm.as_raw_fd(), KVM_CHECK_EXTENSION, cap) }
    };
    Some(KvmCaps {
        dirty_ring: extension(KVM_CAP_DIRTY_LOG_RING) > 0
            || extension(KVM_CAP_DIRTY_LOG_RING_ACQ_REL) > 0,
        sync_regs: extension(KVM_CAP_SYNC_REGS) & SYNC_REGS_AND_SREGS == SYNC_REGS_AND_SREGS,
    })
}

/// CAP_NET_ADMIN's bit in the capability sets.
const CAP_NET_ADMIN: u32 = 12;

/// TAP devices can be made: `/dev/net/tun` opens, this process has
/// CAP_NET_ADMIN, and `ip` is there to make them.
fn probe_tap() -> bool {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .is_ok();
    tun && has_capability(CAP_NET_ADMIN) && find_on_path("ip").is_some()
}

/// Whether `cap` is in this process's effective set (`CapEff` in
/// /proc/self/status).
fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|set| set & (1 << cap) != 0)
}

fn probe_fio_nbd() -> bool {
    let Some(fio) = find_on_path("fio") else {
        return false;
    };
    Command::new(fio)
        .arg("--enghelp=nbd")
        .output()
        .is_ok_and(|out| {
            String::from_utf8_lossy(&out.stdout).contains("uri")
                || String::from_utf8_lossy(&out.stderr).contains("uri")
        })
}

fn path_dirs() -> Vec<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).filter(|d| d.is_dir()).collect())
        .unwrap_or_default()
}

/// `name` as an executable file in a PATH folder.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    path_dirs().into_iter().map(|d| d.join(name)).find(|p| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cfg_is_declared_and_a_forced_off_kvm_sets_all_three() {
        // The variable is read by `instructions`; set only in this test.
        std::env::set_var(NO_KVM, "1");
        let out = instructions(&[Need::Kvm, Need::Tool("no-such-tool.x")]);
        std::env::remove_var(NO_KVM);
        for cfg in [
            "no_kvm",
            "no_kvm_dirty_ring",
            "no_kvm_sync_regs",
            "no_no_such_tool_x",
        ] {
            assert!(
                out.contains(&format!("cargo::rustc-check-cfg=cfg({cfg})")),
                "{out:?}"
            );
            assert!(out.contains(&format!("cargo::rustc-cfg={cfg}")), "{out:?}");
        }
        assert!(out.contains(&format!("cargo::rerun-if-env-changed={NO_KVM}")));
    }

    #[test]
    fn tools_on_path_are_found() {
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("no-such-tool.x").is_none());
        assert_eq!(tool_cfg("qemu-img"), "no_qemu_img");
        assert_eq!(tool_cfg("mkfs.ext4"), "no_mkfs_ext4");
    }
}
