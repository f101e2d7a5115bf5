//! `kemari-bench`: side-by-side measurements of kemari against its peers, printed
//! as tables. Each figure is measured in the same run on the same machine, so
//! ratios are meaningful even where absolute times are noisy.
//!
//! `kemari-bench boot --kernel guest.elf`: time from process start to the
//! guest's first line on the serial console, kemari vs QEMU (`-M microvm`,
//! `-accel kvm`), at several memory sizes.
//!
//! `kemari-bench availability`: downtime and total time of whole-VM operations
//! (snapshot/restore, warm restart, zero-copy migration) vs QEMU
//! (`kemari::bench::availability`).

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
    /// Whole-VM state: downtime and total time of reboot, snapshot/restore,
    /// warm restart and zero-copy migration, kemari vs QEMU.
    Availability(kemari::bench::availability::AvailabilityArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
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
        Bench::Availability(args) => {
            let opts = args.options(sibling("kemari"));
            match kemari::bench::availability::run(&opts) {
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
        "host",
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
