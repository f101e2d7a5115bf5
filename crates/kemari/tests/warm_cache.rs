//! The warm disk cache (`--disk nbd://…,cache=SIZE`, docs/warm-cache.md)
//! with real kemari processes, the test guest and a real `kemari-nbd serve`:
//!
//! - after an in-place reboot the guest's reads are served from the cache:
//!   its hit counter rises by every block read (`GET /vm/metrics`, `GET
//!   /metrics`) and the NBD server counts no further read
//!   (`kemari-nbd access-counts`);
//! - the guest never reads stale data: each boot reads the disk
//!   (`disk=verify`) and writes a new generation of it (`disk=write,…,next`),
//!   and every boot must read exactly the previous boot's generation —
//!   across in-place reboots (cache warm), a warm restart, a zero-copy
//!   migration away (where the data is rewritten by the other VMM) and
//!   back, and a kill -9 followed by a restore from a snapshot taken before
//!   the last rewrite.
//!
//! Bounds are generous (60 s): the machine is shared.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kemari::api::client::request_with_timeout;
use kemari_testkit::scenario::*;
use kemari_testkit::*;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(60);
/// 4 KiB blocks each boot reads (8 MiB).
const BLOCKS: u64 = 2048;
const BANNER: &str = "kemari-guest: hello";

/// The test's NBD export, with what the test asks of it.
struct Server(NbdExport);

impl Server {
    /// Read requests the server has served (`kemari-nbd access-counts`).
    fn reads(&self) -> u64 {
        let out = run_with_timeout(
            Command::new(bins::built_debug_bin("kemari-nbd", "kemari-nbd"))
                .args(["access-counts", &self.0.url]),
            PATIENCE,
        );
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .map(|l| l.split(' ').nth(1).unwrap().parse::<u64>().unwrap())
            .sum()
    }

    /// Writes generation 0 (sequence numbers 0..BLOCKS) through a kemari
    /// without a cache, which then ends.
    fn prefill(&self) {
        let out = run_with_timeout(
            kemari()
                .arg("--kernel")
                .arg(guest_elf())
                .args(["--memory", "128M", "--cmdline"])
                .arg(format!("disk=write,{BLOCKS},seq,flush poweroff=done"))
                .arg("--disk")
                .arg(&self.0.url),
            Duration::from_secs(120),
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(&format!("disk: write done blocks={BLOCKS}")),
            "{text}"
        );
    }
}

fn occurrences(console: &Path, needle: &str) -> usize {
    read_text(console).matches(needle).count()
}

/// The disk's cache counters (`GET /vm/metrics`).
fn cache(api: &Path) -> Value {
    let m = request_with_timeout(api, "GET", "/vm/metrics", None, PATIENCE).expect("metrics");
    let blk = m["devices"]
        .as_array()
        .unwrap_or_else(|| panic!("{m}"))
        .iter()
        .find(|d| d["kind"] == "virtio-blk")
        .cloned()
        .unwrap_or_else(|| panic!("{m}"));
    blk["counters"]["cache"].clone()
}

fn n(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn guest_args(ip: &str, tap: &str, url: &str, cmdline: &str) -> Vec<String> {
    vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        "--memory".into(),
        "128M".into(),
        "--cmdline".into(),
        format!("counter=500 ip={ip}/24 {cmdline}"),
        "--disk".into(),
        format!("{url},cache=32M"),
        "--net".into(),
        format!("tap={tap}"),
    ]
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn reads_after_an_in_place_reboot_come_from_the_cache_not_the_nbd_server() {
    let _one = one_at_a_time();
    let dir = scratch("warm-cache-hits");
    let server = Server(serve_nbd(&dir));
    server.prefill();
    let net = TapNet::create("wc", 71);
    let ip = net.guest_ip();
    let vmm = spawn_vmm(
        &guest_args(
            &ip,
            &net.name,
            &server.0.url,
            &format!("disk=verify,{BLOCKS}"),
        ),
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    let verified = format!("disk: verify ok blocks={BLOCKS}\n");
    wait_for("the first boot's reads", PATIENCE, || {
        occurrences(&vmm.console, &verified) == 1
    });
    // Cold: every block came from the server.
    let cold = cache(&vmm.api);
    assert_eq!(
        (n(&cold, "hits"), n(&cold, "misses")),
        (0, BLOCKS),
        "{cold}"
    );
    assert_eq!(n(&cold, "resident_bytes"), BLOCKS * 4096, "{cold}");
    assert_eq!(n(&cold, "capacity_bytes"), 32 << 20, "{cold}");
    let server_reads = server.reads();
    assert!(server_reads > 0);

    ask_guest_reboot(&ip);
    wait_for("the second boot's reads", PATIENCE, || {
        occurrences(&vmm.console, &verified) == 2
    });
    assert_eq!(occurrences(&vmm.console, BANNER), 2);
    let warm = cache(&vmm.api);
    assert_eq!(n(&warm, "hits"), BLOCKS, "{warm}");
    assert_eq!(n(&warm, "hit_bytes"), BLOCKS * 4096, "{warm}");
    assert_eq!(n(&warm, "misses"), BLOCKS, "no new miss: {warm}");
    assert_eq!(server.reads(), server_reads, "the server saw reads again");

    let mut s = std::os::unix::net::UnixStream::connect(&vmm.api).unwrap();
    use std::io::{Read, Write};
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kemari\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    let line = |name: &str, label: &str, value: u64| {
        page.lines().any(|l| {
            l.starts_with(&format!("{name}{{"))
                && l.contains(label)
                && l.ends_with(&format!(" {value}"))
        })
    };
    assert!(
        line("kemari_device_cache_blocks_total", "result=\"hit\"", BLOCKS),
        "{page}"
    );
    assert!(
        line(
            "kemari_device_cache_read_bytes_total",
            "result=\"miss\"",
            BLOCKS * 4096
        ),
        "{page}"
    );
    assert!(
        line(
            "kemari_device_cache_resident_bytes",
            "device=\"block0\"",
            BLOCKS * 4096
        ),
        "{page}"
    );
    let out = ctl(&vmm.api, &["shutdown"]);
    assert!(out.status.success(), "{out:?}");
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
}

/// What the boots of one console read and wrote: each `(min, max)` of
/// `disk: verify seq`, each `from` of `disk: write seq`.
fn generations(console: &Path) -> (Vec<(u64, u64)>, Vec<u64>) {
    let text = read_text(console);
    let mut read = Vec::new();
    let mut written = Vec::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("disk: verify seq min=") {
            let (lo, hi) = rest.split_once(" max=").unwrap();
            read.push((lo.parse().unwrap(), hi.parse().unwrap()));
        } else if let Some(from) = l.strip_prefix("disk: write seq from=") {
            written.push(from.parse().unwrap());
        }
    }
    (read, written)
}

/// Follows the generations on the disk: each boot must read exactly the
/// one the boot before it wrote.
struct Generations {
    /// The first sequence number of the newest generation on the disk.
    newest: u64,
}

impl Generations {
    /// Waits for boot `boot` (counted in `console`) to finish its jobs, then
    /// checks it read the newest generation whole and wrote the next.
    fn boot_done(&mut self, console: &Path, boot: usize, what: &str) {
        let done = format!("disk: write done blocks={BLOCKS}\n");
        wait_for(what, PATIENCE, || occurrences(console, &done) == boot);
        let (read, written) = generations(console);
        assert_eq!(
            read.get(boot - 1),
            Some(&(self.newest, self.newest + BLOCKS - 1)),
            "{what}: the guest did not read the newest data\n{}",
            read_text(console)
        );
        assert_eq!(
            occurrences(console, &format!("disk: verify ok blocks={BLOCKS}\n")),
            boot,
            "{what}"
        );
        self.newest += BLOCKS;
        assert_eq!(written.get(boot - 1), Some(&self.newest), "{what}");
    }
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn a_cached_disk_never_serves_stale_data_across_reboots_restarts_migrations_and_kill() {
    let _one = one_at_a_time();
    let dir = scratch("warm-cache-stale");
    let server = Server(serve_nbd(&dir));
    server.prefill();
    let mut disk = Generations { newest: 0 };
    let net = TapNet::create("wd", 72);
    let ip = net.guest_ip();
    let memfile = PathBuf::from(format!("/dev/shm/kemari-warm-cache-{}", std::process::id()));
    let _ = std::fs::remove_file(&memfile);
    let mut args = guest_args(
        &ip,
        &net.name,
        &server.0.url,
        &format!("disk=verify,{BLOCKS} disk=write,{BLOCKS},seq,flush,next"),
    );
    args.extend(["--memory-file".into(), memfile.display().to_string()]);
    let mut a = spawn_vmm(&args, &dir.join("console-a.log"), &dir.join("a.sock"), &[]);

    // In-place reboots: the cache stays warm, the guest reads what it wrote.
    disk.boot_done(&a.console, 1, "boot 1");
    for boot in 2..=3 {
        ask_guest_reboot(&ip);
        disk.boot_done(&a.console, boot, "a reboot with the cache warm");
        let c = cache(&a.api);
        assert!(n(&c, "hits") >= (boot as u64 - 1) * BLOCKS, "{c}");
    }

    // A warm restart: the successor starts cold and reads the newest data.
    let warm_dir = dir.join("warm");
    let out = ctl(&a.api, &["warm-restart", warm_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(wait_exit(&mut a.child.0, "the old VMM").success());
    let b = spawn_vmm(
        &["--restore".into(), warm_dir.display().to_string()],
        &dir.join("console-b.log"),
        &dir.join("b.sock"),
        &[],
    );
    wait_for("the restored guest", PATIENCE, || {
        counters(&b.console).len() >= 2
    });
    let c = cache(&b.api);
    assert_eq!((n(&c, "hits"), n(&c, "resident_bytes")), (0, 0), "{c}");
    ask_guest_reboot(&ip);
    disk.boot_done(&b.console, 1, "a reboot after a warm restart");

    // Migrations away and back: the data is rewritten by the other VMM in
    // between, and neither end may show an older generation.
    let mut from = b;
    for (i, tag) in ["c", "d"].into_iter().enumerate() {
        let sock = dir.join(format!("incoming-{tag}.sock"));
        let to = spawn_vmm(
            &["--incoming-local".into(), sock.display().to_string()],
            &dir.join(format!("console-{tag}.log")),
            &dir.join(format!("{tag}.sock")),
            &[],
        );
        wait_for("the destination's socket", PATIENCE, || sock.exists());
        let out = ctl(&from.api, &["migrate-local", sock.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        assert!(wait_exit(&mut from.child.0, "the source VMM").success());
        let c = cache(&to.api);
        assert_eq!(n(&c, "resident_bytes"), 0, "a migrated VM starts cold: {c}");
        ask_guest_reboot(&ip);
        disk.boot_done(
            &to.console,
            1,
            &format!("a reboot after migration {}", i + 1),
        );
        // A second reboot on this side reads from its (now warm) cache.
        ask_guest_reboot(&ip);
        disk.boot_done(&to.console, 2, "a warm reboot after a migration");
        from = to;
    }

    // kill -9, then a restore from a snapshot taken before the last
    // rewrite: the restored VMM must read the rewrite, not the snapshot's
    // time (nor anything the killed one had cached).
    let snap = dir.join("snap");
    let out = ctl(&from.api, &["snapshot", snap.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    ask_guest_reboot(&ip);
    disk.boot_done(&from.console, 3, "a reboot after the snapshot");
    let pid = from.child.0.id();
    // SAFETY: kill(2) on the pid of a child this test spawned and still owns.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let _ = from.child.0.wait();
    let _ = std::fs::remove_file(&memfile);
    let e = spawn_vmm(
        &["--restore".into(), snap.display().to_string()],
        &dir.join("console-e.log"),
        &dir.join("e.sock"),
        &[],
    );
    wait_for("the guest restored from the snapshot", PATIENCE, || {
        counters(&e.console).len() >= 2
    });
    ask_guest_reboot(&ip);
    disk.boot_done(&e.console, 1, "a reboot after kill -9 and restore");
    let out = ctl(&e.api, &["shutdown"]);
    assert!(out.status.success(), "{out:?}");
    let mut child = e.child;
    assert!(wait_exit(&mut child.0, "the last VMM").success());
    let _ = std::fs::remove_file(&memfile);
}
