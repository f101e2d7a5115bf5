//! The state container's cost: encode and decode of a real `VmState`, the
//! work every migration pause and every fault-tolerance sync does once.
//!
//! The test guest boots in this process (one VM per vCPU count, a disk
//! attached so that a virtio device is in the state), runs for a moment and
//! is paused and saved; that state is then encoded and decoded `rounds`
//! times, interleaved, and the medians are printed — and, before that, the
//! first encode and decode (the first VM's are the process's first:
//! what `format::warm_up` spares a migration's pause). Run the same command on
//! two commits to compare encodings (docs/benchmarks.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmm::config::{DiskConfig, MachineConfig, SerialConfig};
use vmm::machine::Machine;
use vmm::persist::format;
use vmm::vstate::VmEventSink;

use crate::report::{Report, Table};
use serde_json::json;

/// `kemari-bench state-codec`.
#[derive(Debug, clap::Args)]
pub struct StateCodecArgs {
    /// The test guest ELF (`cargo build -p guest --target x86_64-unknown-none --release`).
    #[arg(long, default_value = "target/x86_64-unknown-none/release/guest")]
    pub guest: PathBuf,
    /// vCPU counts, one VM each.
    #[arg(long, value_delimiter = ',', default_values = ["1", "2"])]
    pub vcpus: Vec<u8>,
    /// Encodes and decodes measured per VM (the median is reported).
    #[arg(long, default_value_t = 2000)]
    pub rounds: usize,
}

/// Why the measurement could not be made.
#[derive(Debug, thiserror::Error)]
pub enum StateCodecError {
    /// The guest is missing.
    #[error("the test guest {0} is missing (cargo build -p guest --target x86_64-unknown-none --release)")]
    NoGuest(PathBuf),
    /// Scratch files.
    #[error("scratch disk {path}: {source}")]
    Disk {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The VM could not be built or saved.
    #[error(transparent)]
    Machine(#[from] vmm::machine::MachineError),
    /// The state does not survive its own encoding.
    #[error(transparent)]
    Format(#[from] format::FormatError),
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Boots one VM per vCPU count, saves it, and prints the state's size and
/// the median encode and decode times.
pub fn run(args: &StateCodecArgs, report: &mut Report) -> Result<(), StateCodecError> {
    if !args.guest.exists() {
        return Err(StateCodecError::NoGuest(args.guest.clone()));
    }
    report.param("vcpus", args.vcpus.clone());
    report.param("rounds", args.rounds);
    report.param("format_version", format::FORMAT_VERSION);
    let mut table = Table::new(
        format!(
            "state container v{}: encode and decode of a saved test guest (256M, one disk), µs (median of {})",
            format::FORMAT_VERSION,
            args.rounds
        ),
        &["vcpus", "bytes", "encode", "decode", "first encode", "first decode"],
    );
    println!(
        "state container format v{}: encode and decode of a saved test guest (256M, one disk), median of {} µs",
        format::FORMAT_VERSION,
        args.rounds
    );
    println!("  vcpus      bytes     encode     decode");
    for &vcpus in &args.vcpus {
        let disk = std::env::temp_dir().join(format!(
            "kemari-bench-codec-{}-{vcpus}.img",
            std::process::id()
        ));
        let sized = std::fs::File::create(&disk).and_then(|f| f.set_len(16 << 20));
        sized.map_err(|source| StateCodecError::Disk {
            path: disk.clone(),
            source,
        })?;
        let config = MachineConfig {
            vcpus,
            memory_bytes: 256 << 20,
            memory_backing: Default::default(),
            kernel: args.guest.clone(),
            initramfs: None,
            cmdline: "counter=50".into(),
            serial: SerialConfig::Null,
            disks: vec![DiskConfig {
                path: disk.clone(),
                read_only: false,
                cache_bytes: None,
            }],
            nets: Vec::new(),
            pmem: Vec::new(),
            id: None,
            name: None,
        };
        let saved = Machine::build(config, VmEventSink::new(|_| {}), false).and_then(|mut m| {
            std::thread::sleep(Duration::from_millis(300));
            m.pause_and_save()
        });
        let _ = std::fs::remove_file(&disk);
        let state = saved?;
        // The process's first encode and decode, before `warm_up` (what a
        // migration would pay inside the pause without it).
        let t = Instant::now();
        let bytes = format::encode(&state)?;
        let cold_encode = t.elapsed();
        let t = Instant::now();
        format::decode(&bytes)?;
        let cold_decode = t.elapsed();
        format::warm_up();
        let (mut enc, mut dec) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds.max(1) {
            let t = Instant::now();
            let b = std::hint::black_box(format::encode(&state)?);
            enc.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(format::decode(&b)?);
            dec.push(t.elapsed());
        }
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        report.run(json!({
            "vcpus": vcpus,
            "bytes": bytes.len(),
            "first_encode_us": us(cold_encode),
            "first_decode_us": us(cold_decode),
            "encode_us": enc.iter().map(|d| us(*d)).collect::<Vec<_>>(),
            "decode_us": dec.iter().map(|d| us(*d)).collect::<Vec<_>>(),
        }));
        let (enc, dec) = (median(enc), median(dec));
        table.row(vec![
            vcpus.into(),
            bytes.len().into(),
            us(enc).into(),
            us(dec).into(),
            us(cold_encode).into(),
            us(cold_decode).into(),
        ]);
        println!(
            "  {vcpus:>5} {:>10} {:>10.1} {:>10.1}   first in this VM's turn: {:.1} / {:.1}",
            bytes.len(),
            us(enc),
            us(dec),
            us(cold_encode),
            us(cold_decode)
        );
    }
    report.table(table);
    Ok(())
}
