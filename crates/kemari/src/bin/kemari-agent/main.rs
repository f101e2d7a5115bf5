//! `kemari-agent`: the fleet's host agent, one per host (crates/fleet,
//! docs/fleet.md). It registers the host in etcd as a place for standbys,
//! keeps the records of the VMs whose API sockets lie in its VM folder,
//! re-protects a VM after a failover by starting a standby on a free host,
//! and serves the fleet page.
//!
//! A separate binary rather than a mode of `kemari`: a `kemari` process
//! runs one VM, confined (seccomp) and without an async runtime; the agent
//! is a long-lived host daemon with an etcd client and an HTTP listener,
//! and it must outlive the VMs it starts.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fleet::agent::{run, AgentConfig};
use ft::fence::etcd::EtcdSpec;

/// The fleet's host agent: registers this host in etcd, keeps the records
/// of its VMs, and starts standbys to re-protect VMs after a failover.
#[derive(Debug, Parser)]
#[command(name = "kemari-agent", version)]
struct Args {
    /// The etcd cluster and prefix, as the VMs' `--ft-fence`
    /// (etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=S][&cacert=…]).
    #[arg(long, env = "KEMARI_ETCD")]
    etcd: String,
    /// This host's name in the fleet (unique).
    #[arg(long)]
    host_name: String,
    /// The address this host's standbys listen on (reachable by primaries).
    #[arg(long)]
    address: String,
    /// Folder of the VMs' API sockets (`ID.sock`): start each primary here
    /// with `--api-socket DIR/ID.sock`; standbys started by the agent go
    /// here too (socket, console, log, pid file).
    #[arg(long)]
    vm_dir: PathBuf,
    /// The migration key file (the same on every host).
    #[arg(long)]
    key_file: PathBuf,
    /// How many standbys this host may run.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Extra arguments for each standby, split on spaces, `{id}` replaced
    /// by the VM's id (e.g. "--net tap=tap-{id}").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    standby_args: String,
    /// The sync link's peer timeout for `ft start`, ms.
    #[arg(long)]
    ft_timeout_ms: Option<u64>,
    /// Serve the fleet page (GET /fleet, /fleet.json) on ADDR:PORT.
    #[arg(long)]
    http: Option<String>,
    /// The kemari binary for standbys (default: beside this one).
    #[arg(long)]
    kemari: Option<PathBuf>,
    /// Log filter (error, warn, info, debug, trace, or a tracing filter).
    #[arg(long, env = kemari_logging::ENV, default_value = "info")]
    log_level: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = kemari_logging::init(&args.log_level, false) {
        eprintln!("kemari-agent: error: {e}");
        return ExitCode::from(2);
    }
    let spec = match EtcdSpec::parse(&args.etcd) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kemari-agent: error: --etcd: {e}");
            return ExitCode::from(2);
        }
    };
    let kemari = args.kemari.unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("kemari")))
            .unwrap_or_else(|| "kemari".into())
    });
    let cfg = AgentConfig {
        etcd: args.etcd,
        spec,
        host: args.host_name,
        address: args.address,
        vm_dir: std::path::absolute(&args.vm_dir).unwrap_or(args.vm_dir),
        key_file: std::path::absolute(&args.key_file).unwrap_or(args.key_file),
        kemari,
        slots: args.slots,
        standby_args: args
            .standby_args
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        ft_timeout_ms: args.ft_timeout_ms,
        http: args.http,
    };
    match fleet::store::block_on(run(cfg)).and_then(|r| r) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kemari-agent: error: {e}");
            ExitCode::from(1)
        }
    }
}
