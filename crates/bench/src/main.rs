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
//!
//! Every subcommand takes `--json FILE|-` (`kemari_bench::report`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use kemari_bench::report::{Report, Sink, Table};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "kemari-bench",
    version,
    about = "Side-by-side benchmarks for kemari"
)]
struct Cli {
    #[command(subcommand)]
    command: Bench,
    /// Also write the results as JSON to FILE (`-`: to standard output, the
    /// text then goes to standard error); `scripts/bench-report` reads them.
    #[arg(long, global = true, value_name = "FILE|-")]
    json: Option<String>,
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
    let cli = Cli::parse();
    let sink = match Sink::open(cli.json.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kemari-bench: {e}");
            return ExitCode::from(1);
        }
    };
    let mut report = Report::new(cli.command.name());
    let result = run(cli.command, &mut report);
    if let Err(e) = result {
        eprintln!("kemari-bench: {e}");
        return ExitCode::from(1);
    }
    match sink.write(&report) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kemari-bench: {e}");
            ExitCode::from(1)
        }
    }
}

impl Bench {
    /// The subcommand's name, as typed.
    fn name(&self) -> &'static str {
        match self {
            Bench::Boot { .. } => "boot",
            Bench::DirtyHarvest { .. } => "dirty-harvest",
            Bench::Availability(_) => "availability",
            Bench::Ft(_) => "ft",
            Bench::Api(_) => "api",
            Bench::StateCodec(_) => "state-codec",
            Bench::MemoryImage(_) => "memory-image",
        }
    }
}

fn run(bench: Bench, report: &mut Report) -> Result<(), String> {
    match bench {
        Bench::DirtyHarvest {
            memory,
            pages,
            rounds,
        } => dirty::harvest_bench(&memory, pages, rounds.max(1), report),
        Bench::Boot {
            kernel,
            cmdline,
            memory,
            runs,
            kemari,
            qemu,
        } => {
            let kemari = kemari.unwrap_or_else(|| sibling("kemari"));
            boot_bench(
                &kernel,
                &cmdline,
                &memory,
                runs.max(1),
                &kemari,
                &qemu,
                report,
            )
        }
        Bench::Ft(args) => kemari_bench::ft::run(&args, sibling("kemari"), report),
        Bench::Api(args) => kemari_bench::api::run(&args, &sibling("kemari"), report),
        Bench::StateCodec(args) => {
            kemari_bench::state_codec::run(&args, report).map_err(|e| e.to_string())
        }
        Bench::MemoryImage(args) => {
            kemari_bench::memory_image::run(&args, report).map_err(|e| e.to_string())
        }
        Bench::Availability(args) => {
            let opts = args.options(sibling("kemari"));
            kemari_bench::availability::run(&opts, report).map_err(|e| e.to_string())
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
    report: &mut Report,
) -> Result<(), String> {
    report.param("kernel", kernel.display().to_string());
    report.param("memory", memory.to_vec());
    report.param("runs", runs);
    let mut table = Table::new(
        format!("process start to first guest output line, ms (median of {runs} runs)"),
        &["memory", "kemari", "qemu-microvm", "qemu/kemari"],
    );
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
        for run in 0..runs {
            let tk = time_to_first_line(kemari_cmd(kemari, kernel, cmdline, mem))?;
            let tq = time_to_first_line(qemu_cmd(qemu, kernel, cmdline, mem))?;
            for (vmm, t) in [("kemari", tk), ("qemu-microvm", tq)] {
                report.run(json!({ "memory": mem, "run": run, "vmm": vmm, "ms": ms(t) }));
            }
            k.push(tk);
            q.push(tq);
        }
        let (k, q) = (median(k), median(q));
        kemari_medians.push(k);
        table.row(vec![
            mem.as_str().into(),
            ms(k).into(),
            ms(q).into(),
            (q.as_secs_f64() / k.as_secs_f64()).into(),
        ]);
        println!(
            "{:>8} {:>10.1} {:>14.1} {:>11.1}x",
            mem,
            ms(k),
            ms(q),
            q.as_secs_f64() / k.as_secs_f64()
        );
    }
    report.table(table);
    if let (Some(first), Some(last)) = (kemari_medians.first(), kemari_medians.last()) {
        let line = format!(
            "kemari {} vs {}: {:.2}x",
            memory.last().map(String::as_str).unwrap_or(""),
            memory.first().map(String::as_str).unwrap_or(""),
            last.as_secs_f64() / first.as_secs_f64()
        );
        println!("{line}");
        report.note(line);
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

    use kemari_bench::report::{Report, Table};
    use serde_json::json;

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

    pub fn harvest_bench(
        memory: &[String],
        pages: u16,
        rounds: usize,
        report: &mut Report,
    ) -> Result<(), String> {
        report.param("memory", memory.to_vec());
        report.param("pages", pages);
        report.param("rounds", rounds);
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
        let mut table = Table::new(
            format!("one harvest with {pages} dirty pages, µs (median of {rounds})"),
            &["memory", "ring", "bitmap", "bitmap/ring"],
        );
        for (i, &(name, _)) in sizes.iter().enumerate() {
            for rig in &rigs[2 * i..2 * i + 2] {
                report.run(json!({
                    "memory": name,
                    "kind": format!("{:?}", rig.kind).to_lowercase(),
                    "us": rig.times.iter().map(|t| us(*t)).collect::<Vec<_>>(),
                }));
            }
            let ring = rigs[2 * i].median();
            let bitmap = rigs[2 * i + 1].median();
            table.row(vec![
                name.into(),
                us(ring).into(),
                us(bitmap).into(),
                (bitmap.as_secs_f64() / ring.as_secs_f64()).into(),
            ]);
            println!(
                "{:>8} {:>10.2} {:>10.2} {:>11.1}x",
                name,
                us(ring),
                us(bitmap),
                bitmap.as_secs_f64() / ring.as_secs_f64()
            );
            rows.push((name, ring, bitmap));
        }
        report.table(table);
        if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
            let flat = last.1.as_secs_f64() / first.1.as_secs_f64();
            let gain = last.2.as_secs_f64() / last.1.as_secs_f64();
            let lines = [
                format!(
                    "ring {} vs {}: {flat:.2}x (goal: <= 1.2x) {}",
                    last.0,
                    first.0,
                    if flat <= 1.2 { "MET" } else { "NOT MET" }
                ),
                format!(
                    "bitmap/ring at {}: {gain:.1}x (goal: >= 10x) {}",
                    last.0,
                    if gain >= 10.0 { "MET" } else { "NOT MET" }
                ),
            ];
            for line in lines {
                println!("{line}");
                report.note(line);
            }
        }
        Ok(())
    }
}
