//! `kemari-bench … --json`: the results file of two fast benches, as the
//! binary writes it (`scripts/bench-report` reads these files).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kemari-bench"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kemari-bench-json-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The envelope every bench writes.
fn check_envelope(v: &Value, bench: &str) {
    assert_eq!(v["schema"], 1);
    assert_eq!(v["bench"], bench);
    assert!(v["command"].as_str().unwrap().contains(bench));
    assert!(v["started"].as_str().unwrap().ends_with('Z'));
    assert!(v["finished"].is_string());
    assert!(v["host"]["cpus"].as_u64().unwrap() >= 1);
    assert!(v["host"]["kernel"].is_string());
    assert_eq!(v["host"]["loadavg_start"].as_array().unwrap().len(), 3);
}

#[test]
fn memory_image_writes_its_results_to_a_file() {
    let dir = scratch("image");
    let file = dir.join("memory-image.json");
    let out = bench()
        .args([
            "memory-image",
            "--memory",
            "64M",
            "--runs",
            "2",
            "--work-dir",
        ])
        .arg(&dir)
        .arg("--json")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The text still goes to standard output.
    assert!(String::from_utf8_lossy(&out.stdout).contains("memory image restore"));
    let v: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    check_envelope(&v, "memory-image");
    assert_eq!(v["params"]["runs"], 2);
    let run = &v["runs"][0];
    assert_eq!(run["memory"], "64M");
    assert_eq!(run["unchecked_ms"].as_array().unwrap().len(), 2);
    assert_eq!(run["checked_ms"].as_array().unwrap().len(), 2);
    let table = &v["tables"][0];
    assert_eq!(table["columns"][2], "unchecked");
    let row = table["rows"][0].as_array().unwrap();
    assert_eq!(row.len(), table["columns"].as_array().unwrap().len());
    assert_eq!(row[0], "64M");
    assert!(row[2].as_f64().unwrap() > 0.0);
}

#[test]
fn an_unwritable_json_file_is_an_error_naming_it() {
    let dir = scratch("unwritable");
    let out = bench()
        .args([
            "memory-image",
            "--memory",
            "16M",
            "--runs",
            "1",
            "--work-dir",
        ])
        .arg(&dir)
        .args(["--json", "/nonexistent-kemari-dir/x.json"])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot write the JSON results to /nonexistent-kemari-dir/x.json"),
        "{err}"
    );
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn dirty_harvest_prints_json_alone_on_standard_output() {
    let out = bench()
        .args([
            "dirty-harvest",
            "--memory",
            "256M,1G",
            "--rounds",
            "10",
            "--json",
            "-",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Standard output is the JSON and nothing else; the table went to stderr.
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("bitmap/ring"));
    check_envelope(&v, "dirty-harvest");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "ring and bitmap at two sizes");
    assert!(runs.iter().all(|r| r["us"].as_array().unwrap().len() == 10));
    let rows = v["tables"][0]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1][0], "1G");
    assert!(v["notes"][0]
        .as_str()
        .unwrap()
        .starts_with("ring 1G vs 256M"));
}
