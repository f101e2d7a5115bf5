//! `kemari-nbd`'s command line: the `kemari-nbd` binary parses it, and the
//! packaging's generator (crates/xtask) renders its man pages and shell
//! completions from it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::allow::AllowList;
use crate::server::{Exports, ServerConfig, Tls, TlsMode};
use crate::tls::TlsServer;

#[derive(Parser)]
#[command(
    name = "kemari-nbd",
    version,
    about = "NBD target server and relocation proxy"
)]
pub struct Cli {
    /// Log filter: a level (off, error, warn, info, debug, trace) or tracing
    /// directives such as warn,kemari_nbd=debug.
    #[arg(long, global = true, env = kemari_logging::ENV,
          default_value = kemari_logging::DEFAULT_LEVEL, value_parser = kemari_logging::check_filter)]
    pub log_level: String,
    /// Logs as JSON lines.
    #[arg(long, global = true)]
    pub log_json: bool,
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Who may connect, and how: TLS and the client allow-list.
#[derive(Args)]
pub struct Access {
    /// TLS: off (STARTTLS refused), on (offered), require (nothing but
    /// STARTTLS before TLS).
    #[arg(long, default_value = "off", value_name = "off|on|require")]
    pub tls: TlsMode,
    /// X.509: DIR holds server-cert.pem, server-key.pem and, to require
    /// client certificates, ca-cert.pem.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    pub tls_certificates: Option<PathBuf>,
    /// TLS-PSK: FILE holds IDENTITY:HEXKEY lines (psktool's format).
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// Serve only clients from ADDR[/PREFIX] (repeatable; TCP listeners;
    /// default: everyone).
    #[arg(long = "allow", value_name = "ADDR[/PREFIX]")]
    pub allow: Vec<String>,
    /// Also serve GET /metrics (Prometheus text format) over TCP on this
    /// address (`127.0.0.1:9401`); a proxy's --control socket always
    /// serves it.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Close a connection whose client has not finished the NBD handshake
    /// within SECS seconds (0: no limit).
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub handshake_limit: u64,
    /// Serve at most N connections at once; more are closed at once (0: no
    /// limit).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub max_connections: usize,
}

impl Access {
    /// Binds `--metrics-listen`, if given.
    pub fn metrics_listener(
        &self,
    ) -> Result<Option<kemari_api::metrics_listener::MetricsListener>> {
        self.metrics_listen
            .as_deref()
            .map(kemari_api::metrics_listener::MetricsListener::bind)
            .transpose()
            .map_err(Into::into)
    }

    /// The server's configuration for `exports` on `listen`.
    pub fn config(&self, exports: Exports, listen: &str) -> Result<ServerConfig> {
        let server = match (&self.tls_certificates, &self.tls_psk) {
            (Some(dir), _) => Some(TlsServer::with_certificates(dir)?),
            (_, Some(file)) => Some(TlsServer::with_psk_file(file)?),
            (None, None) => None,
        };
        if self.tls == TlsMode::Off && server.is_some() {
            bail!("TLS credentials given but --tls is off: add --tls on or --tls require");
        }
        let tls = Tls::new(self.tls, server.map(Arc::new))
            .context("--tls on and --tls require need --tls-certificates DIR or --tls-psk FILE")?;
        let allow = AllowList::parse(&self.allow)?;
        if !allow.is_empty() && listen.starts_with("unix:") {
            bail!("--allow applies to TCP listeners; {listen} is a Unix socket (use its file permissions)");
        }
        Ok(ServerConfig {
            exports,
            tls,
            allow,
            handshake_limit: (self.handshake_limit > 0)
                .then(|| std::time::Duration::from_secs(self.handshake_limit)),
            max_connections: self.max_connections,
        })
    }
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Serve image files as NBD exports.
    Serve {
        /// NAME=PATH[,ro]; repeat for several exports.
        #[arg(long = "export", required = true)]
        exports: Vec<String>,
        /// HOST:PORT or unix:PATH.
        #[arg(long, default_value = "127.0.0.1:10809")]
        listen: String,
        #[command(flatten)]
        access: Access,
    },
    /// Serve an export relocated from an upstream target or proxy.
    Proxy {
        /// nbd://HOST:PORT/EXPORT or nbd+unix:///EXPORT?socket=PATH.
        #[arg(long)]
        upstream: String,
        /// Directory for cache.img and cache.bitmap.
        #[arg(long)]
        cache: PathBuf,
        /// Name of the export offered to clients.
        #[arg(long, default_value = "")]
        export: String,
        /// HOST:PORT or unix:PATH.
        #[arg(long, default_value = "127.0.0.1:10810")]
        listen: String,
        #[command(flatten)]
        access: Access,
        /// Control socket for status/pause/resume/cutover (JSON lines) and
        /// GET /metrics (HTTP).
        #[arg(long)]
        control: Option<PathBuf>,
        /// Background copy rate limit, bytes/s (suffixes K, M, G).
        #[arg(long)]
        rate_limit: Option<String>,
        /// Background bytes in flight (suffixes K, M).
        #[arg(long, default_value = "1M")]
        bg_window: String,
        /// Background bytes in flight while a client waits on a fetch
        /// (default: half of --bg-window).
        #[arg(long)]
        bg_window_busy: Option<String>,
        /// Start with the background copy paused.
        #[arg(long)]
        no_background: bool,
        /// Cut over only on `kemari-nbd cutover`.
        #[arg(long)]
        no_auto_cutover: bool,
    },
    /// Print a proxy's status as JSON.
    Status {
        #[arg(long)]
        control: PathBuf,
        /// Follow the background copy until the cut-over instead: a bar on
        /// a terminal (blocks held locally, rates, phase), else one line a
        /// second.
        #[arg(long)]
        watch: bool,
    },
    /// Pause a proxy's background copy.
    Pause {
        #[arg(long)]
        control: PathBuf,
    },
    /// Resume a proxy's background copy.
    Resume {
        #[arg(long)]
        control: PathBuf,
    },
    /// Cut a proxy over to standalone now, or as soon as every block is copied.
    Cutover {
        #[arg(long)]
        control: PathBuf,
        /// Wait until the cut-over has happened.
        #[arg(long)]
        wait: bool,
    },
    /// Print an export's per-group access counts (kemari NBD extension).
    AccessCounts { url: String },
    /// Random 4 KiB reads of listed blocks for a while; prints JSON (benchmark).
    #[command(hide = true)]
    RandomReads {
        url: String,
        /// File of 4 KiB block numbers (whitespace separated).
        #[arg(long)]
        blocks: PathBuf,
        #[arg(long, default_value_t = 30)]
        secs: u64,
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// A TCP relay that delays every chunk (WAN emulation for benchmarks).
    #[command(hide = true)]
    Relay {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        to: String,
        #[arg(long, default_value_t = 10)]
        delay_ms: u64,
    },
}
