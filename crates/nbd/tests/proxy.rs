//! The relocation proxy end to end with the real binary: real clients
//! through the proxy, cut-over with the target stopped, crash and restart,
//! chaining, and the ext-first background order.

mod common;

use common::*;
use kemari_testkit::*;
use nbd_client::client::Client;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const SIZE: usize = 128 << 20;

/// Blocks marked in a persisted bitmap file.
fn persisted_bits(dir: &Path) -> Vec<u64> {
    let raw = std::fs::read(dir.join("cache.bitmap")).unwrap();
    raw[64..]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn count(bits: &[u64]) -> u64 {
    bits.iter().map(|w| u64::from(w.count_ones())).sum()
}

#[test]
fn real_clients_through_proxy_then_cutover_without_target() {
    let d = TempDir::new("px");
    let mut expect = make_image(&d.path("t.img"), SIZE, 21);
    let (target, tport) = serve(&[format!("disk={}", d.path("t.img").display())]);
    let ctl = d.path("ctl.sock");
    let (_proxy, pport) = proxy(
        &format!("nbd://127.0.0.1:{tport}/disk"),
        &d.path("cache"),
        &ctl,
        &["--no-background"],
    );
    let purl = format!("nbd://127.0.0.1:{pport}/disk");
    if tool("nbdinfo") {
        let out = run(Command::new("nbdinfo").args(["--json", &purl]));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["exports"][0]["export-size"], SIZE as u64);
    }
    // Sub-block writes to uncached blocks (the proxy fetches them first).
    if tool("qemu-io") {
        run(Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            "write -P 0x11 1000 100",
            "-c",
            "write -P 0x22 8190 10000",
            "-c",
            "write -z 40000000 5000",
            "-c",
            "flush",
            &purl,
        ]));
        expect[1000..1100].fill(0x11);
        expect[8190..18190].fill(0x22);
        expect[40_000_000..40_005_000].fill(0);
    }
    // Our client: writes and reads with many requests in flight.
    let c = Client::connect(&purl).unwrap();
    let data = pattern(300_000, 99);
    c.write_at(50_000_123, &data).unwrap();
    expect[50_000_123..50_300_123].copy_from_slice(&data);
    let mut b = vec![0u8; 1 << 20];
    c.read_at(60 << 20, &mut b).unwrap();
    assert!(b == expect[60 << 20..61 << 20]);
    // Large writes: inside the now cached range (zero-copy into the cache
    // file), and straddling its end (an uncached, partly written last block:
    // the buffered path fetches it first); large reads of cached ranges.
    let inside = pattern(300_000, 98);
    c.write_at((60 << 20) + 5000, &inside).unwrap();
    expect[(60 << 20) + 5000..(60 << 20) + 305_000].copy_from_slice(&inside);
    let straddle = pattern(200_001, 97);
    let at = (61 << 20) - 100_000;
    c.write_at(at as u64, &straddle).unwrap();
    expect[at..at + 200_001].copy_from_slice(&straddle);
    let mut b = vec![0u8; (1 << 20) + 200_000];
    c.read_at(60 << 20, &mut b).unwrap();
    assert!(b == expect[60 << 20..(61 << 20) + 200_000]);
    drop(c);
    if tool("fio") {
        let help = sh("fio --enghelp=nbd 2>&1 || true");
        if String::from_utf8_lossy(&help).contains("uri") {
            sh(&format!(
                "fio --name=r --ioengine=nbd --uri={purl} --rw=randread --bs=4k --size=32M \
                 --iodepth=16 --runtime=2 --time_based >/dev/null"
            ));
        }
    }
    if tool("nbdcopy") {
        run(Command::new("nbdcopy").arg(&purl).arg(d.path("out1.img")));
        assert!(std::fs::read(d.path("out1.img")).unwrap() == expect);
    }
    // Finish the copy, cut over, stop the target: everything still reads back.
    control_cmd("resume", &ctl);
    run(Command::new(BIN)
        .args(["cutover", "--wait", "--control"])
        .arg(&ctl));
    let st = status(&ctl);
    assert_eq!(st["cut_over"], true);
    assert_eq!(st["cached_percent"], 100.0);
    target.crash();
    let c = Client::connect(&purl).unwrap();
    let mut all = vec![0u8; SIZE];
    c.read_at(0, &mut all).unwrap();
    assert!(all == expect);
    c.write_at(4096, &[0x77; 4096]).unwrap();
    let big = pattern(1 << 20, 96);
    c.write_at_fua((90 << 20) + 777, &big).unwrap();
    expect[(90 << 20) + 777..(91 << 20) + 777].copy_from_slice(&big);
    if tool("qemu-img") {
        drop(c);
        run(Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &purl])
            .arg(d.path("out2.img")));
        expect[4096..8192].fill(0x77);
        assert!(std::fs::read(d.path("out2.img")).unwrap() == expect);
    }
}

#[test]
fn crash_mid_copy_resumes_without_refetching() {
    let d = TempDir::new("crash");
    let mut expect = make_image(&d.path("t.img"), SIZE, 31);
    let (_target, tport) = serve(&[format!("disk={}", d.path("t.img").display())]);
    let up = format!("nbd://127.0.0.1:{tport}/disk");
    let ctl = d.path("ctl.sock");
    let cache = d.path("cache");
    let port = free_port();
    let p = proxy_on(&up, &cache, &ctl, port, &["--rate-limit", "24M"]);
    let purl = format!("nbd://127.0.0.1:{port}/disk");
    let c = Client::connect(&purl).unwrap();
    // A flushed write must survive the crash; so must a FUA write.
    c.write_at(77 << 20, &[0xaa; 10_000]).unwrap();
    c.flush().unwrap();
    c.write_at_fua(99 << 20, &[0xbb; 5000]).unwrap();
    expect[77 << 20..(77 << 20) + 10_000].fill(0xaa);
    expect[99 << 20..(99 << 20) + 5000].fill(0xbb);
    drop(c);
    wait_for("some background progress", Duration::from_secs(20), || {
        status(&ctl)["cached_blocks"].as_u64().unwrap_or(0) > 2000
    });
    p.crash();
    let before = persisted_bits(&cache);
    let persisted = count(&before);
    let total = (SIZE / 4096) as u64;
    assert!(persisted > 0 && persisted < total, "persisted {persisted}");
    // Restart without background copy: cached blocks are trusted, not refetched.
    let _p2 = proxy_on(&up, &cache, &ctl, port, &["--no-background"]);
    let st = status(&ctl);
    assert_eq!(st["cached_blocks"].as_u64().unwrap(), persisted);
    let c = Client::connect(&purl).unwrap();
    let mut all = vec![0u8; SIZE];
    c.read_at(0, &mut all).unwrap();
    assert!(all == expect, "data differs after crash and restart");
    let st = status(&ctl);
    let fetched = st["ondemand_bytes"].as_u64().unwrap();
    assert!(
        fetched <= (total - persisted) * 4096,
        "refetched cached blocks: fetched {fetched}, uncached {}",
        (total - persisted) * 4096
    );
    assert_eq!(st["cached_percent"], 100.0);
}

#[test]
fn chained_proxies() {
    let d = TempDir::new("chain");
    let expect = make_image(&d.path("t.img"), 64 << 20, 41);
    let (target, tport) = serve(&[format!("disk={}", d.path("t.img").display())]);
    let (_p1, port1) = proxy(
        &format!("nbd://127.0.0.1:{tport}/disk"),
        &d.path("c1"),
        &d.path("ctl1.sock"),
        &["--no-background", "--no-auto-cutover"],
    );
    let ctl2 = d.path("ctl2.sock");
    let (_p2, port2) = proxy(
        &format!("nbd://127.0.0.1:{port1}/disk"),
        &d.path("c2"),
        &ctl2,
        &[],
    );
    wait_for("second proxy cut-over", Duration::from_secs(60), || {
        status(&ctl2)["cut_over"] == true
    });
    // The first proxy cached everything the second one pulled through it.
    run(Command::new(BIN)
        .args(["cutover", "--wait", "--control"])
        .arg(d.path("ctl1.sock")));
    target.crash();
    let c = Client::connect(&format!("nbd://127.0.0.1:{port2}/disk")).unwrap();
    let mut all = vec![0u8; 64 << 20];
    c.read_at(0, &mut all).unwrap();
    assert!(all == expect);
    let c1 = Client::connect(&format!("nbd://127.0.0.1:{port1}/disk")).unwrap();
    c1.read_at(0, &mut all).unwrap();
    assert!(all == expect);
}

#[test]
#[cfg_attr(no_mkfs_ext4, ignore = "needs mkfs.ext4 (e2fsprogs)")]
fn background_copy_fetches_ext_used_blocks_first() {
    let d = TempDir::new("ext");
    let img = d.path("fs.img");
    let src = d.path("files");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("big"), pattern(24 << 20, 5)).unwrap();
    std::fs::write(src.join("small"), b"hello").unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-d"])
        .arg(&src)
        .arg(&img));
    let f = std::fs::File::open(&img).unwrap();
    let mut rd = |o: u64, b: &mut [u8]| f.read_exact_at(b, o);
    let used = kemari_nbd::ext::used_blocks(&mut rd, 256 << 20, 4096)
        .unwrap()
        .expect("ext4 found");
    let nused = (0..65536u64).filter(|&b| used.contains(b)).count() as u64;
    assert!(nused > 6000 && nused < 40000, "used blocks {nused}");
    let (_t, tport) = serve(&[format!("disk={}", img.display())]);
    let ctl = d.path("ctl.sock");
    let cache = d.path("cache");
    let (_p, _port) = proxy(
        &format!("nbd://127.0.0.1:{tport}/disk"),
        &cache,
        &ctl,
        &["--rate-limit", "16M"],
    );
    wait_for("partial copy", Duration::from_secs(20), || {
        status(&ctl)["cached_blocks"].as_u64().unwrap_or(0) > nused / 2
    });
    control_cmd("pause", &ctl);
    std::thread::sleep(Duration::from_millis(600));
    let bits = persisted_bits(&cache);
    let cached: Vec<u64> = (0..65536u64)
        .filter(|&b| bits[(b / 64) as usize] & (1 << (b % 64)) != 0)
        .collect();
    let in_used = cached.iter().filter(|&&b| used.contains(b)).count();
    assert!(cached.len() as u64 >= nused / 2);
    assert!(
        in_used as f64 >= 0.97 * cached.len() as f64,
        "{in_used} of {} cached blocks are in use by ext4",
        cached.len()
    );
}

#[test]
fn status_watch_follows_the_copy_to_the_cut_over_in_plain_lines() {
    let d = TempDir::new("px-watch");
    make_image(&d.path("t.img"), 16 << 20, 5);
    let (_target, tport) = serve(&[format!("disk={}", d.path("t.img").display())]);
    let ctl = d.path("ctl.sock");
    let upstream = format!("nbd://127.0.0.1:{tport}/disk");
    // Slowed down, so that the watch sees the copy under way.
    let (_proxy, _pport) = proxy(&upstream, &d.path("cache"), &ctl, &["--rate-limit", "8M"]);
    let out = run_with_timeout(
        Command::new(BIN)
            .args(["status", "--watch", "--control"])
            .arg(&ctl),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    let prefix = format!("proxy of {upstream}: ");
    assert!(lines.iter().all(|l| l.starts_with(&prefix)), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes off a terminal: {text}"
    );
    let last = lines.last().expect("at least one line");
    assert!(
        last.starts_with(&format!("{prefix}cut-over: 4096/4096 blocks (100%)")),
        "{text}"
    );
    // The copy's blocks never go back.
    let blocks: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.split(": ").nth(2)?.split('/').next()?.parse().ok())
        .collect();
    assert!(blocks.windows(2).all(|w| w[0] <= w[1]), "{text}");
}
