//! `kemari-agent`'s command line: the binary parses it, and the
//! packaging's generator (crates/xtask) renders its man page from it.

use std::path::PathBuf;

use clap::Parser;

/// The fleet's host agent: registers this host in etcd, keeps the records
/// of its VMs, and starts standbys to re-protect VMs after a failover.
#[derive(Debug, Parser)]
#[command(name = "kemari-agent", version)]
pub struct Args {
    /// The etcd cluster and prefix, as the VMs' `--ft-fence`
    /// (etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=S][&cacert=…]).
    #[arg(long, env = "KEMARI_ETCD")]
    pub etcd: String,
    /// This host's name in the fleet (unique).
    #[arg(long)]
    pub host_name: String,
    /// The address this host's standbys listen on (reachable by primaries).
    #[arg(long)]
    pub address: String,
    /// Folder of the VMs' API sockets (`ID.sock`): start each primary here
    /// with `--api-socket DIR/ID.sock`; standbys started by the agent go
    /// here too (socket, console, log, pid file).
    #[arg(long)]
    pub vm_dir: PathBuf,
    /// The migration key file (the same on every host).
    #[arg(long)]
    pub key_file: PathBuf,
    /// How many standbys this host may run.
    #[arg(long, default_value_t = 4)]
    pub slots: u32,
    /// Extra arguments for each standby, split on spaces, `{id}` replaced
    /// by the VM's id (e.g. "--net tap=tap-{id}").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub standby_args: String,
    /// The sync link's peer timeout for `ft start`, ms.
    #[arg(long)]
    pub ft_timeout_ms: Option<u64>,
    /// Serve the fleet page (GET /fleet, /fleet.json) on ADDR:PORT.
    #[arg(long)]
    pub http: Option<String>,
    /// The kemari binary for standbys (default: beside this one).
    #[arg(long)]
    pub kemari: Option<PathBuf>,
    /// Log filter (error, warn, info, debug, trace, or a tracing filter).
    #[arg(long, env = kemari_logging::ENV, default_value = "info")]
    pub log_level: String,
}
