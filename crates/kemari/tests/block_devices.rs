//! virtio-blk end to end with the test guest: written blocks land in the image
//! file (checked from the host, block by block), a read-only disk answers
//! writes with an I/O error the guest sees while the VMM runs on, and a disk
//! served over NBD by kemari-nbd round-trips the same way.

use std::io::Read;
use std::path::Path;

use std::time::Duration;

use guest::blockfmt::{self, BlockState, BLOCK_SIZE};
use kemari_testkit::scenario::*;
use kemari_testkit::*;

/// Checks blocks `0..n` of an image from the host.
fn host_check(image: &Path, n: u64) -> (u64, u64, u64) {
    let mut f = std::fs::File::open(image).unwrap();
    let (mut valid, mut missing, mut corrupt) = (0, 0, 0);
    let mut buf = [0u8; BLOCK_SIZE];
    for block in 0..n {
        f.read_exact(&mut buf).unwrap();
        match blockfmt::check(&buf, block) {
            BlockState::Valid { .. } => valid += 1,
            BlockState::Missing => missing += 1,
            BlockState::Corrupt => corrupt += 1,
        }
    }
    (valid, missing, corrupt)
}

fn boot_to_end(args: &[String]) -> (std::process::ExitStatus, String) {
    let out = run_with_timeout(
        kemari()
            .arg("--kernel")
            .arg(guest_elf())
            .args(["--memory", "128M"])
            .args(args),
        Duration::from_secs(120),
    );
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Blocks `0..n` of the disk at `url` verify from a guest that reads
/// them, and `image`'s from the host.
fn verify_through(url: &str, image: &Path, n: u64) {
    let (st, out) = boot_to_end(&[
        "--cmdline".into(),
        format!("disk=verify,{n} poweroff=done"),
        "--disk".into(),
        url.to_owned(),
    ]);
    assert!(
        st.success() && out.contains(&format!("disk: verify ok blocks={n}")),
        "{out}"
    );
    assert_eq!(host_check(image, n), (n, 0, 0));
}

/// The VM's first disk as `kemarictl devices` shows it.
fn first_disk(api: &Path) -> serde_json::Value {
    let devices = run_with_timeout(kemarictl(api).arg("devices"), Duration::from_secs(10));
    let d: serde_json::Value = serde_json::from_slice(&devices.stdout).unwrap();
    d.as_array()
        .unwrap()
        .iter()
        .find(|d| d["kind"] == "virtio-blk")
        .cloned()
        .expect("a virtio-blk device")
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn written_blocks_land_in_the_image_file() {
    let _turn = one_at_a_time();
    let dir = scratch("blk-image");
    let disk = disk_image(&dir);
    let (st, out) = boot_to_end(&[
        "--cmdline".into(),
        "disk=write,600,rand,flush poweroff=done".into(),
        "--disk".into(),
        disk.display().to_string(),
    ]);
    assert!(st.success(), "{out}");
    assert!(out.contains("disk: write done blocks=600"), "{out}");
    // The VMM has exited: the file alone must hold every block.
    assert_eq!(host_check(&disk, 600), (600, 0, 0));
    // And nothing beyond what was written.
    let (_, missing, corrupt) = host_check(&disk, 700);
    assert_eq!((missing, corrupt), (100, 0));
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn read_only_disk_refuses_writes_and_the_vmm_runs_on() {
    let _turn = one_at_a_time();
    let dir = scratch("blk-ro");
    let disk = disk_image(&dir);
    let before = std::fs::read(&disk).unwrap();
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--cmdline".into(),
            "counter=100 disk=write,50,seq disk_errors=continue".into(),
            "--disk".into(),
            format!("{},ro", disk.display()),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for(
        "the guest to see the error",
        Duration::from_secs(30),
        || read_text(&vmm.console).contains("disk: error: request failed status=1"),
    );
    // The VMM keeps running the guest, and counts the error.
    let n = counters(&vmm.console).len();
    wait_for("the guest to go on", Duration::from_secs(30), || {
        counters(&vmm.console).len() > n + 3
    });
    let blk = first_disk(&vmm.api);
    assert!(blk["counters"]["errors"].as_u64().unwrap() >= 1, "{blk}");
    assert!(blk["backend"].as_str().unwrap().contains("read-only"));
    assert!(
        run_with_timeout(kemarictl(&vmm.api).arg("shutdown"), Duration::from_secs(10))
            .status
            .success()
    );
    assert!(
        std::fs::read(&disk).unwrap() == before,
        "a read-only disk was modified"
    );
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn disk_over_nbd_round_trips() {
    let _turn = one_at_a_time();
    let dir = scratch("blk-nbd");
    let server = serve_nbd(&dir);
    let (disk, url) = (&server.disk, server.url.clone());
    let (st, out) = boot_to_end(&[
        "--cmdline".into(),
        "disk=write,800,seq,flush poweroff=done".into(),
        "--disk".into(),
        url.clone(),
    ]);
    assert!(
        st.success() && out.contains("disk: write done blocks=800"),
        "{out}"
    );
    verify_through(&url, disk, 800);
    // A server that is not there is a clear error.
    let out = run_with_timeout(
        kemari().arg("--kernel").arg(guest_elf()).args([
            "--memory",
            "128M",
            "--disk",
            "nbd://127.0.0.1:1/none",
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open NBD disk"));
}

/// kemari-nbd killed (SIGKILL) while the guest writes and flushes, and
/// started again on the same socket 300 ms later: the disk reconnects (and
/// counts it), the guest's writes go on without an I/O error, and every
/// block verifies.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn disk_over_nbd_rides_through_a_server_restart() {
    let _turn = one_at_a_time();
    let dir = scratch("blk-nbd-restart");
    let disk = disk_image(&dir);
    let sock = dir.join("nbd.sock");
    let serve = || {
        let child = std::process::Command::new(kemari_testkit::bins::built_debug_bin(
            "kemari-nbd",
            "kemari-nbd",
        ))
        .args(["serve", "--export"])
        .arg(format!("vmdisk={}", disk.display()))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn kemari-nbd");
        let child = KillOnDrop(child);
        wait_for("the NBD server", Duration::from_secs(30), || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        });
        child
    };
    let mut server = serve();
    let url = format!("nbd+unix:///vmdisk?socket={}", sock.display());
    let mut vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--cmdline".into(),
            "disk=write,3000,seq,flush,burst=20/20 counter=200".into(),
            "--disk".into(),
            url.clone(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for("1000 acknowledged writes", Duration::from_secs(60), || {
        read_text(&vmm.console).contains("disk: acked=1000")
    });
    server.0.kill().unwrap();
    let _ = server.0.wait();
    std::thread::sleep(Duration::from_millis(300));
    let _server = serve();
    wait_for("the guest's last write", Duration::from_secs(120), || {
        read_text(&vmm.console).contains("disk: write done")
            || vmm.child.0.try_wait().unwrap().is_some()
    });
    let out = read_text(&vmm.console);
    assert!(out.contains("disk: write done blocks=3000"), "{out}");
    let blk = first_disk(&vmm.api);
    assert_eq!(blk["counters"]["reconnects"], 1, "{blk}");
    let metrics = kemari_testkit::http::scrape(kemari_testkit::http::over_unix(
        &vmm.api,
        &kemari_testkit::http::get("/metrics"),
    ));
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kemari_device_reconnects_total{")
                && l.contains("device=\"block0\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    assert!(
        run_with_timeout(kemarictl(&vmm.api).arg("shutdown"), Duration::from_secs(10))
            .status
            .success()
    );
    let status = wait_exit(&mut vmm.child.0, "the VMM after shutdown");
    assert!(status.success(), "{status:?}");
    assert!(!out.contains("disk: error"), "{out}");
    assert!(
        read_text(&vmm.console).contains("disk: acked=2000"),
        "the writes did not go on after the restart"
    );
    verify_through(&url, &disk, 3000);
}
