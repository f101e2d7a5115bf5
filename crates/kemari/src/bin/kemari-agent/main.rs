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

use std::process::ExitCode;

use clap::Parser;
use fleet::agent::{run, AgentConfig};
use ft::fence::etcd::EtcdSpec;
use kemari::agent_cli::Args;

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
