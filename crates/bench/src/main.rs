//! `kemari-bench`: side-by-side measurements of kemari against its peers, printed
//! as tables. Each figure is measured in the same run on the same machine, so
//! ratios are meaningful even where absolute times are noisy.
//!
//! `kemari-bench boot --kernel guest.elf`: time from process start to the
//! guest's first line on the serial console, kemari vs QEMU (`-M microvm`,
//! `-accel kvm`), at several memory sizes.
//!
//! `kemari-bench dirty-harvest`: the cost of one dirty-page harvest with 16
//! pages dirtied by a vCPU, KVM dirty ring vs dirty bitmap, at 256 MiB to
//! 16 GiB of guest memory (docs/dirty-tracking.md).
//! `kemari-bench availability`: downtime and total time of whole-VM operations
//! (snapshot/restore, warm restart, zero-copy migration) vs QEMU
//! (`kemari_bench::availability`).
//! `kemari-bench state-codec`: encode and decode of a real saved VM state
//! (`kemari_bench::state_codec`); `kemari-bench memory-image`: a snapshot's
//! memory image restored with and without its checksums.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kemari-bench",
    version,
    about = "Side-by-side benchmarks for kemari"
)]
struct Cli {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Process start to first guest output line: kemari vs QEMU.
    Boot {
        /// PVH ELF kernel both VMMs boot (the test guest).
        #[arg(long)]
        kernel: PathBuf,
        /// Kernel command line.
        #[arg(long, default_value = "")]
        cmdline: String,
        /// Memory sizes to measure.
        #[arg(long, value_delimiter = ',', default_values = ["256M", "4G"])]
        memory: Vec<String>,
        /// Runs per configuration (the median is reported).
        #[arg(long, default_value_t = 10)]
        runs: usize,
        /// The kemari binary (default: next to this one).
        #[arg(long)]
        kemari: Option<PathBuf>,
        /// The QEMU binary.
        #[arg(long, default_value = "qemu-system-x86_64")]
        qemu: String,
    },
    /// One dirty-page harvest with N vCPU-dirtied pages: ring vs bitmap.
    DirtyHarvest {
        /// Guest memory sizes.
        #[arg(long, value_delimiter = ',', default_values = ["256M", "1G", "4G", "16G"])]
        memory: Vec<String>,
        /// Pages the guest dirties between two harvests (at most 200).
        #[arg(long, default_value_t = 16)]
        pages: u16,
        /// Harvests measured per configuration (the median is reported).
        #[arg(long, default_value_t = 1000)]
        rounds: usize,
    },
    /// Whole-VM state: downtime and total time of reboot, snapshot/restore,
    /// warm restart and zero-copy migration, kemari vs QEMU.
    Availability(kemari_bench::availability::AvailabilityArgs),
    /// Fault tolerance: TCP request/response and stream, O_SYNC-style and
    /// buffered disk writes, sync pause and link bytes — unprotected vs
    /// event-driven vs periodic checkpoints, at several memory sizes.
    Ft(kemari_bench::ft::FtBenchArgs),
    /// The control API's answer times: behind 1,000 idle connections and a
    /// slow client, and during a live migration.
    Api(kemari_bench::api::ApiBenchArgs),
    /// The state container: encode and decode of a real saved VM state.
    StateCodec(kemari_bench::state_codec::StateCodecArgs),
    /// A snapshot's memory image restored with and without its per-extent
    /// checksums.
    MemoryImage(kemari_bench::memory_image::MemoryImageArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Bench::DirtyHarvest {
            memory,
            pages,
            rounds,
        } => match dirty::harvest_bench(&memory, pages, rounds.max(1)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemari-bench: {e}");
                ExitCode::from(1)
            }
        },
        Bench::Boot {
            kernel,
            cmdline,
            memory,
            runs,
            kemari,
            qemu,
        } => {
            let kemari = kemari.unwrap_or_else(|| sibling("kemari"));
            match boot_bench(&kernel, &cmdline, &memory, runs.max(1), &kemari, &qemu) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kemari-bench: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Bench::Ft(args) => match kemari_bench::ft::run(&args, sibling("kemari")) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemari-bench: {e}");
                ExitCode::from(1)
            }
        },
        Bench::Api(args) => match kemari_bench::api::run(&args, &sibling("kemari")) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemari-bench: {e}");
                ExitCode::from(1)
            }
        },
        Bench::StateCodec(args) => match kemari_bench::state_codec::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemari-bench: {e}");
                ExitCode::from(1)
            }
        },
        Bench::MemoryImage(args) => match kemari_bench::memory_image::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemari-bench: {e}");
                ExitCode::from(1)
            }
        },
        Bench::Availability(args) => {
            let opts = args.options(sibling("kemari"));
            match kemari_bench::availability::run(&opts) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kemari-bench: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Starts `cmd` and returns the time until its first stdout line.
fn time_to_first_line(mut cmd: Command) -> Result<Duration, String> {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut line = String::new();
    let read = BufReader::new(stdout).read_line(&mut line);
    let elapsed = start.elapsed();
    finish(&mut child);
    match read {
        Ok(n) if n > 0 && line.ends_with('\n') => Ok(elapsed),
        _ => Err(format!(
            "{:?} printed no line (is the kernel right?)",
            cmd.get_program()
        )),
    }
}

fn finish(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn kemari_cmd(kemari: &Path, kernel: &Path, cmdline: &str, mem: &str) -> Command {
    let mut c = Command::new(kemari);
    c.arg("--kernel").arg(kernel).args([
        "--memory",
        mem,
        "--cmdline",
        cmdline,
        "--serial",
        "stdout",
    ]);
    c
}

fn qemu_cmd(qemu: &str, kernel: &Path, cmdline: &str, mem: &str) -> Command {
    let mut c = Command::new(qemu);
    c.args([
        "-accel",
        "kvm",
        "-M",
        "microvm,x-option-roms=off,rtc=off,isa-serial=on",
        "-cpu",
        kemari_bench::QEMU_CPU,
        "-m",
        mem,
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-serial",
        "stdio",
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=4",
        "-append",
        cmdline,
        "-kernel",
    ])
    .arg(kernel);
    c
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn boot_bench(
    kernel: &Path,
    cmdline: &str,
    memory: &[String],
    runs: usize,
    kemari: &Path,
    qemu: &str,
) -> Result<(), String> {
    println!("boot: process start -> first guest output line (median of {runs} runs, ms)");
    println!("kernel: {}", kernel.display());
    println!(
        "{:>8} {:>10} {:>14} {:>12}",
        "memory", "kemari", "qemu-microvm", "qemu/kemari"
    );
    let mut kemari_medians = Vec::new();
    for mem in memory {
        let mut k = Vec::new();
        let mut q = Vec::new();
        // Interleave the two so that machine noise hits both alike.
        for _ in 0..runs {
            k.push(time_to_first_line(kemari_cmd(
                kemari, kernel, cmdline, mem,
            ))?);
            q.push(time_to_first_line(qemu_cmd(qemu, kernel, cmdline, mem))?);
        }
        let (k, q) = (median(k), median(q));
        kemari_medians.push(k);
        println!(
            "{:>8} {:>10.1} {:>14.1} {:>11.1}x",
            mem,
            ms(k),
            ms(q),
            q.as_secs_f64() / k.as_secs_f64()
        );
    }
    if let (Some(first), Some(last)) = (kemari_medians.first(), kemari_medians.last()) {
        println!(
            "kemari {} vs {}: {:.2}x",
            memory.last().map(String::as_str).unwrap_or(""),
            memory.first().map(String::as_str).unwrap_or(""),
            last.as_secs_f64() / first.as_secs_f64()
        );
    }
    Ok(())
}

/// `dirty-harvest`: a VM per (size, kind) with one vCPU running
/// [`PageWriter`](vmm::dirty::page_writer::PageWriter) (writes `pages` pages,
/// then `out`); the bench runs the vCPU on its own thread, so between rounds
/// the vCPU is outside KVM_RUN and a plain harvest is complete.
mod dirty {
    use std::time::{Duration, Instant};

    use vmm::dirty::page_writer::PageWriter;
    use vmm::dirty::{DirtyTracker, DirtyTrackerConfig, DirtyTrackerKind, DirtyTrackingMode};
    use vmm::memory::{GuestMemoryFile, MemoryBacking};
    use vmm::vstate::vcpu::Vcpu;
    use vmm::vstate::vm::Vm;

    const PORT: u16 = 0x510;
    const WARMUP: usize = 20;

    /// "256M", "4G", "1024K" or bytes.
    pub fn parse_size(s: &str) -> Result<u64, String> {
        let (num, shift) = match s.as_bytes().last() {
            Some(b'K' | b'k') => (&s[..s.len() - 1], 10),
            Some(b'M' | b'm') => (&s[..s.len() - 1], 20),
            Some(b'G' | b'g') => (&s[..s.len() - 1], 30),
            _ => (s, 0),
        };
        num.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(1 << shift))
            .ok_or_else(|| format!("bad memory size {s:?}"))
    }

    fn ctx<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
        move |err| format!("{what}: {err}")
    }

    /// One VM of the benchmark: its memory, tracker, vCPU and harvest times.
    struct Rig {
        bytes: u64,
        kind: DirtyTrackerKind,
        _file: GuestMemoryFile,
        vm: Vm,
        tracker: std::sync::Arc<DirtyTracker>,
        vcpu: Vcpu,
        writer: PageWriter,
        times: Vec<Duration>,
    }

    impl Rig {
        fn new(bytes: u64, kind: DirtyTrackerKind, pages: u16) -> Result<Self, String> {
            let file = GuestMemoryFile::create(bytes, &MemoryBacking::Memfd)
                .map_err(ctx("guest memory"))?;
            let mem = file.map().map_err(ctx("guest memory"))?;
            let vm = Vm::new().map_err(ctx("VM"))?;
            let mode = match kind {
                DirtyTrackerKind::Ring => DirtyTrackingMode::Ring,
                DirtyTrackerKind::Bitmap => DirtyTrackingMode::Bitmap,
            };
            let config = DirtyTrackerConfig {
                mode,
                ..Default::default()
            };
            let tracker = DirtyTracker::new(&vm, &mem, config).map_err(ctx("tracker"))?;
            vm.register_memory(&mem).map_err(ctx("memory slots"))?;
            let mut vcpu = Vcpu::new(vm.fd(), 0).map_err(ctx("vCPU"))?;
            tracker.attach_vcpu(&mut vcpu).map_err(ctx("ring"))?;
            let writer = PageWriter::new(16, pages, PORT).map_err(ctx("writer"))?;
            writer.install(&mem, &mut vcpu).map_err(ctx("writer"))?;
            tracker.start().map_err(ctx("start"))?;
            Ok(Rig {
                bytes,
                kind,
                _file: file,
                vm,
                tracker,
                vcpu,
                writer,
                times: Vec::new(),
            })
        }

        /// One guest round, then one timed harvest.
        fn round(&mut self, measure: bool) -> Result<(), String> {
            self.writer
                .run_round(&mut self.vcpu)
                .map_err(ctx("guest"))?;
            let t = Instant::now();
            let got = self.tracker.harvest().map_err(ctx("harvest"))?;
            let elapsed = t.elapsed();
            if got.len() != usize::from(self.writer.pages) {
                return Err(format!(
                    "{:?} at {} bytes: a harvest returned {} pages, expected {}",
                    self.kind,
                    self.bytes,
                    got.len(),
                    self.writer.pages
                ));
            }
            if measure {
                self.times.push(elapsed);
            }
            Ok(())
        }

        fn median(&mut self) -> Duration {
            self.times.sort();
            self.times
                .get(self.times.len() / 2)
                .copied()
                .unwrap_or_default()
        }
    }

    fn us(d: Duration) -> f64 {
        d.as_secs_f64() * 1e6
    }

    pub fn harvest_bench(memory: &[String], pages: u16, rounds: usize) -> Result<(), String> {
        let sizes = memory
            .iter()
            .map(|m| parse_size(m).map(|b| (m.as_str(), b)))
            .collect::<Result<Vec<_>, _>>()?;
        println!(
            "dirty-harvest: one harvest with {pages} pages dirtied by a vCPU \
             (median of {rounds}, µs; includes KVM_RESET_DIRTY_RINGS / KVM_CLEAR_DIRTY_LOG)"
        );
        // Every VM exists at once and the rounds are interleaved, so that
        // noise from other load on the host hits every configuration alike.
        let mut rigs = Vec::new();
        for &(_, bytes) in &sizes {
            for kind in [DirtyTrackerKind::Ring, DirtyTrackerKind::Bitmap] {
                rigs.push(Rig::new(bytes, kind, pages)?);
            }
        }
        if let Some(rig) = rigs.get(1) {
            println!(
                "KVM: dirty ring {:?}; bitmap with manual protect (KVM_CLEAR_DIRTY_LOG): {}",
                rig.vm
                    .dirty_ring_support()
                    .map(|(cap, max)| (cap, max / 16)),
                rig.tracker.manual_protect()
            );
        }
        println!(
            "{:>8} {:>10} {:>10} {:>12}",
            "memory", "ring", "bitmap", "bitmap/ring"
        );
        for round in 0..WARMUP + rounds {
            for rig in &mut rigs {
                rig.round(round >= WARMUP)?;
            }
        }
        let mut rows = Vec::new();
        for (i, &(name, _)) in sizes.iter().enumerate() {
            let ring = rigs[2 * i].median();
            let bitmap = rigs[2 * i + 1].median();
            println!(
                "{:>8} {:>10.2} {:>10.2} {:>11.1}x",
                name,
                us(ring),
                us(bitmap),
                bitmap.as_secs_f64() / ring.as_secs_f64()
            );
            rows.push((name, ring, bitmap));
        }
        if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
            let flat = last.1.as_secs_f64() / first.1.as_secs_f64();
            let gain = last.2.as_secs_f64() / last.1.as_secs_f64();
            println!(
                "ring {} vs {}: {flat:.2}x (goal: <= 1.2x) {}",
                last.0,
                first.0,
                if flat <= 1.2 { "MET" } else { "NOT MET" }
            );
            println!(
                "bitmap/ring at {}: {gain:.1}x (goal: >= 10x) {}",
                last.0,
                if gain >= 10.0 { "MET" } else { "NOT MET" }
            );
        }
        Ok(())
    }
}
