//! `kemarictl`'s command line: the `kemarictl` binary parses it, and the
//! packaging's generator (crates/xtask) renders its man pages and shell
//! completions from it.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Control a running kemari VM.
#[derive(Debug, Parser)]
#[command(name = "kemarictl", version)]
pub struct Cli {
    /// The VMM's API socket (kemari --api-socket); every command but
    /// `fleet` needs it.
    #[arg(long, short = 's', env = "KEMARI_API_SOCKET")]
    pub api_socket: Option<PathBuf>,
    /// Start a long operation and return at once (its id and state) instead
    /// of following it to its end.
    #[arg(long, global = true)]
    pub detach: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// VM info and state.
    Info,
    /// The machine configuration.
    Config,
    /// Devices and their request counters.
    Devices,
    /// Metrics: exits by reason, memory pages, device counters.
    Metrics,
    /// Pause the vCPUs and devices.
    Pause,
    /// Resume a paused VM.
    Resume,
    /// Stop the VM and end the VMM process.
    Shutdown,
    /// Full snapshot (state + sparse memory image, every data extent
    /// checksummed) into DIR; restore it with `kemari --restore DIR`.
    Snapshot {
        /// Snapshot directory (created if missing).
        dir: PathBuf,
        /// End the VMM once saved (suspend to disk).
        #[arg(long)]
        exit: bool,
        /// Replace a snapshot already in DIR (refused otherwise, before the
        /// VM is paused).
        #[arg(long)]
        force: bool,
    },
    /// Warm restart: save the small state file into DIR, keep guest memory in
    /// its file (kemari --memory-file), end this VMM; `kemari --restore DIR`
    /// (possibly a newer binary) resumes the VM without copying memory. If a
    /// successor waits on DIR (`--prepare`, then `kemari --restore DIR
    /// --await-state`), it resumes the VM at once.
    WarmRestart {
        /// State directory.
        dir: PathBuf,
        /// Do not restart yet: write DIR/config.json (the VM runs on) so that
        /// a successor, `kemari --restore DIR --await-state`, can build the
        /// new VM in advance; the next `warm-restart DIR` hands the VM to it.
        #[arg(long)]
        prepare: bool,
    },
    /// Live migration (pre-copy over TCP) to the kemari started with
    /// `--incoming HOST:PORT`; prints the final report.
    Migrate {
        /// Destination HOST:PORT.
        #[arg(long)]
        to: String,
        /// Pre-shared key file (the destination's --migration-key-file).
        #[arg(long)]
        key_file: PathBuf,
        /// Downtime limit in ms (default 300): pause once the rest can move
        /// within it and rounds stop shrinking it (docs/migration-protocol.md).
        #[arg(long)]
        max_downtime_ms: Option<u64>,
        /// Pause the guest after this many rounds whatever remains (default 30).
        #[arg(long)]
        max_rounds: Option<u32>,
        /// Cap the rounds sent while the guest runs at this many MiB/s (as
        /// libvirt's `migrate-setspeed`); the pages sent with the guest
        /// paused are not held back. Default: no cap.
        #[arg(long, value_name = "MIB_S", value_parser = clap::value_parser!(u64).range(1..))]
        max_bandwidth: Option<u64>,
        /// TCP connections to the destination (1–8, default 1): the main
        /// one and N−1 streams the pre-copy pages are spread over, each
        /// sealed and written by its own thread.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=8))]
        connections: Option<u8>,
        /// An authenticated but unencrypted link, for a trusted, dedicated
        /// one (the destination must be started with --plaintext-link).
        #[arg(long)]
        plaintext_link: bool,
    },
    /// Progress of the running (or last) live migration.
    Migration,
    /// Cancel the running live migration (the VM keeps running here).
    MigrateCancel,
    /// Zero-copy migration into the kemari started with `--incoming-local SOCKET`.
    MigrateLocal {
        /// The destination's socket.
        socket: PathBuf,
    },
    /// Fault tolerance: protect this VM with a standby, show its state, stop it.
    Ft {
        #[command(subcommand)]
        command: FtCommand,
    },
    /// The running or last long operation (migrate, migrate-local,
    /// warm-restart, snapshot, ft start): its state, progress and result.
    Operation {
        #[command(subcommand)]
        command: Option<OperationCommand>,
    },
    /// Follow the VM's events (started, paused, resumed, shutdown, reset,
    /// crashed, operation_*, ft_*): one JSON line each, until the VMM ends.
    Events,
    /// The fleet, read from etcd (kemari-agent's registry): every VM, its
    /// primary and standby hosts, state, epoch, sync rate, since when, last
    /// failover. Needs no API socket.
    Fleet {
        /// The etcd cluster and prefix, as the VMs' --ft-fence
        /// (etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?…]).
        #[arg(long, env = "KEMARI_ETCD")]
        etcd: String,
        /// JSON (VMs and hosts) instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum OperationCommand {
    /// Follow it until it ends, with a progress bar on a terminal.
    Follow,
    /// Cancel it (before its commit point the VM keeps running here).
    Cancel,
}

#[derive(Debug, Subcommand)]
pub enum FtCommand {
    /// Synchronize the standby started with `kemari --ft-standby HOST:PORT`
    /// (a live pre-copy, then one sync per output event or per period).
    Start {
        /// The standby's HOST:PORT.
        #[arg(long)]
        peer: String,
        /// Pre-shared key file (the standby's --migration-key-file).
        #[arg(long)]
        key_file: PathBuf,
        /// Periodic checkpoints every MS (Remus-style, outputs held until the
        /// checkpoint is acknowledged) instead of event-driven synchronization.
        #[arg(long)]
        periodic_ms: Option<u64>,
        /// Heartbeat interval on the sync link (default 100 ms).
        #[arg(long)]
        heartbeat_ms: Option<u64>,
        /// The peer is lost after this long without a frame (default 1000 ms).
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Leave up to N pages that the guest rewrites from sync to sync
        /// writable (no write-protection fault on them; each is compared and
        /// sent only if changed). Default 64; 0 re-protects every page.
        #[arg(long, value_name = "N")]
        keep_writable_pages: Option<usize>,
        /// Let up to N epochs be on their way to the standby at once: the
        /// guest's next outputs start their epoch without waiting for the
        /// last one's acknowledgement (pays off on a link with latency).
        /// Default 1.
        #[arg(long, value_name = "N")]
        epochs_in_flight: Option<usize>,
        /// An authenticated but unencrypted link, for a trusted, dedicated
        /// one (the standby must be started with --plaintext-link).
        #[arg(long)]
        plaintext_link: bool,
    },
    /// State (protected, degraded, standby, failed over) and metrics.
    Status,
    /// Stop protection; the standby exits.
    Stop,
}
