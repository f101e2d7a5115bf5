//! The `base:allocation` metadata context: `nbdinfo --map` and `qemu-img
//! map` see the holes of a sparse export, through the target and through a
//! proxy (which reports what its cache knows).

mod common;

use std::process::Command;

use common::*;
use kemari_testkit::*;

/// 4 MiB: data at [0, 64 KiB) and [1 MiB, 1 MiB + 64 KiB), holes elsewhere.
fn sparse(d: &TempDir) -> String {
    sparse_image(&d.path("a.img"), 4 << 20, &[0, 1 << 20]);
    format!("a={}", d.path("a.img").display())
}

/// `nbdinfo --map` as (offset, length, type) rows.
fn nbdinfo_map(url: &str) -> Vec<(u64, u64, u32)> {
    let out = run(Command::new("nbdinfo").args(["--map", url]));
    String::from_utf8_lossy(&out)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect()
}

const HOLE: u32 = 3; // NBD_STATE_HOLE | NBD_STATE_ZERO

#[test]
#[cfg_attr(no_nbdinfo, ignore = "needs nbdinfo (libnbd-bin)")]
fn nbdinfo_map_shows_holes_and_data() {
    let d = TempDir::new("map");
    let (_t, port) = serve(&[sparse(&d)]);
    let map = nbdinfo_map(&format!("nbd://127.0.0.1:{port}/a"));
    assert_eq!(
        map,
        vec![
            (0, 65536, 0),
            (65536, (1 << 20) - 65536, HOLE),
            (1 << 20, 65536, 0),
            ((1 << 20) + 65536, (3 << 20) - 65536, HOLE),
        ]
    );
}

#[test]
#[cfg_attr(no_qemu_img, ignore = "needs qemu-img (qemu-utils)")]
fn qemu_img_map_agrees() {
    let d = TempDir::new("qmap");
    let (_t, port) = serve(&[sparse(&d)]);
    let out = run(Command::new("qemu-img").args([
        "map",
        "--output=json",
        &format!("nbd://127.0.0.1:{port}/a"),
    ]));
    let v: serde_json::Value = serde_json::from_slice(&out).expect("qemu-img map json");
    let rows: Vec<(u64, u64, bool, bool)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
                e["zero"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (0, 65536, true, false),
            (65536, (1 << 20) - 65536, false, true),
            (1 << 20, 65536, true, false),
            ((1 << 20) + 65536, (3 << 20) - 65536, false, true),
        ]
    );
}

#[test]
#[cfg_attr(
    any(no_nbdinfo, no_qemu_io),
    ignore = "needs nbdinfo (libnbd-bin) and qemu-io (qemu-utils)"
)]
fn a_proxy_maps_what_its_cache_knows() {
    let d = TempDir::new("pmap");
    let (_t, port) = serve(&[sparse(&d)]);
    let (_p, pport) = proxy(
        &format!("nbd://127.0.0.1:{port}/a"),
        &d.path("cache"),
        &d.path("p.ctl"),
        &["--no-background"],
    );
    let url = format!("nbd://127.0.0.1:{pport}/disk");
    // Nothing cached: all data (it may hold anything upstream).
    assert_eq!(nbdinfo_map(&url), vec![(0, 4 << 20, 0)]);
    // A discarded range is known to be a hole.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 2097152 1048576", &url]));
    assert_eq!(
        nbdinfo_map(&url),
        vec![
            (0, 2 << 20, 0),
            (2 << 20, 1 << 20, HOLE),
            (3 << 20, 1 << 20, 0)
        ]
    );
}
