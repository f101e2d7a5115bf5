//! Guest memory and CPU state never cross the network in clear: a live
//! migration and a fault-tolerance synchronization go through a relay that
//! records every byte, and a page pattern the guest's memory holds is not
//! found in the recording — unless both ends were told `--plaintext-link`
//! (the documented opt-out for a trusted, dedicated link), which shows that
//! the check can fail.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;

const PATTERN: &[u8] = b"KEMARI-SECRET-GUEST-PAGE-";
/// The guest: 512 MiB, of which the top 64 MiB hold the pattern (the test
/// guest uses the bottom and expects it zeroed).
const MEMORY: u64 = 512 << 20;

/// A /dev/shm memory file whose top 64 MiB are full of [`PATTERN`].
fn memory_with_pattern(tag: &str) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let path = PathBuf::from(format!("/dev/shm/kemari-test-{}-{tag}", std::process::id()));
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(MEMORY).unwrap();
    let chunk: Vec<u8> = PATTERN.iter().cycle().take(1 << 20).copied().collect();
    for i in 0..64u64 {
        f.write_all_at(&chunk, MEMORY - (64 << 20) + (i << 20))
            .unwrap();
    }
    path
}

fn source(dir: &Path, memory: &Path) -> Vmm {
    let args: Vec<String> = vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        "--memory".into(),
        "512M".into(),
        "--memory-file".into(),
        memory.display().to_string(),
        "--cmdline".into(),
        "counter=100".into(),
    ];
    let vmm = spawn_vmm(
        &args,
        &dir.join("console-1.log"),
        &dir.join("api-1.sock"),
        &[],
    );
    wait_for("the guest to count", Duration::from_secs(60), || {
        counters(&vmm.console).len() >= 3
    });
    vmm
}

fn peer(dir: &Path, role: &str, port: u16, tag: &str, plaintext: bool) -> Vmm {
    let mut args: Vec<String> = vec![
        role.into(),
        format!("127.0.0.1:{port}"),
        "--migration-key-file".into(),
        kemari_testkit::test_key(dir).display().to_string(),
    ];
    if plaintext {
        args.push("--plaintext-link".into());
    }
    let vmm = spawn_vmm(
        &args,
        &dir.join(format!("console-{tag}.log")),
        &dir.join(format!("api-{tag}.sock")),
        &[],
    );
    wait_listening(port);
    vmm
}

fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Migrates a guest holding [`PATTERN`] through a recording relay; whether
/// the pattern crossed it.
fn migration_shows_the_pattern(plaintext: bool) -> bool {
    let tag = if plaintext { "lm-plain" } else { "lm-enc" };
    let dir = scratch(tag);
    let memory = memory_with_pattern(tag);
    let mut src = source(&dir, &memory);
    let port = free_port();
    let mut dst = peer(&dir, "--incoming", port, "2", plaintext);
    let relay = Relay::start(port, Duration::ZERO);
    let to = format!("127.0.0.1:{}", relay.port);
    let key = kemari_testkit::test_key(&dir);
    let mut args = vec!["migrate", "--to", &to, "--key-file", key.to_str().unwrap()];
    if plaintext {
        args.push("--plaintext-link");
    }
    succeeded(&ctl(&src.api, &args));
    assert!(src.child.0.wait().unwrap().success());
    wait_for("the guest to count on", Duration::from_secs(30), || {
        counters(&dst.console).len() >= 3
    });
    assert!(ctl(&dst.api, &["shutdown"]).status.success());
    let _ = dst.child.0.wait();
    let _ = std::fs::remove_file(&memory);
    assert!(relay.seen().len() > 64 << 20, "the pages crossed the relay");
    relay.saw(PATTERN)
}

/// Protects a guest holding [`PATTERN`] through a recording relay; whether
/// the pattern crossed it.
fn ft_sync_shows_the_pattern(plaintext: bool) -> bool {
    let tag = if plaintext { "ft-plain" } else { "ft-enc" };
    let dir = scratch(tag);
    let memory = memory_with_pattern(tag);
    let src = source(&dir, &memory);
    let port = free_port();
    let mut sb = peer(&dir, "--ft-standby", port, "2", plaintext);
    let relay = Relay::start(port, Duration::ZERO);
    let peer_addr = format!("127.0.0.1:{}", relay.port);
    let key = kemari_testkit::test_key(&dir);
    let mut args = vec![
        "ft",
        "start",
        "--peer",
        &peer_addr,
        "--key-file",
        key.to_str().unwrap(),
    ];
    if plaintext {
        args.push("--plaintext-link");
    }
    succeeded(&ctl(&src.api, &args));
    // Protected: the initial sync has sent every page the guest has.
    let protected = || {
        let out = ctl(&src.api, &["ft", "status"]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .is_ok_and(|v| v["state"] == "protected" && v["syncs"].as_u64() >= Some(1))
    };
    wait_for("the initial sync", Duration::from_secs(60), protected);
    succeeded(&ctl(&src.api, &["ft", "stop"]));
    let _ = sb.child.0.wait();
    assert!(ctl(&src.api, &["shutdown"]).status.success());
    let _ = std::fs::remove_file(&memory);
    assert!(relay.seen().len() > 64 << 20, "the pages crossed the relay");
    relay.saw(PATTERN)
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_live_migration_shows_no_guest_page_in_clear() {
    let _turn = one_at_a_time();
    assert!(
        !migration_shows_the_pattern(false),
        "a guest page crossed in clear"
    );
    assert!(
        migration_shows_the_pattern(true),
        "the plaintext opt-out must show it: the check works"
    );
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_fault_tolerance_sync_shows_no_guest_page_in_clear() {
    let _turn = one_at_a_time();
    assert!(
        !ft_sync_shows_the_pattern(false),
        "a guest page crossed in clear"
    );
    assert!(
        ft_sync_shows_the_pattern(true),
        "the plaintext opt-out must show it: the check works"
    );
}
