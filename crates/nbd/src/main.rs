//! `kemari-nbd`: NBD target server, relocation proxy and their control CLI.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use kemari_nbd::allow::AllowList;
use kemari_nbd::backend::FileBackend;
use kemari_nbd::proxy::{Proxy, ProxyConfig};
use kemari_nbd::server::{serve, Exports, Listener, ServerConfig, Tls, TlsMode};
use kemari_nbd::tls::TlsServer;
use kemari_nbd::{control, relay, shutdown};
use nbd_client::client::{parse_url, query_access_counts};

#[derive(Parser)]
#[command(
    name = "kemari-nbd",
    version,
    about = "NBD target server and relocation proxy"
)]
struct Cli {
    /// Log filter: a level (off, error, warn, info, debug, trace) or tracing
    /// directives such as warn,kemari_nbd=debug.
    #[arg(long, global = true, env = kemari_logging::ENV,
          default_value = kemari_logging::DEFAULT_LEVEL, value_parser = kemari_logging::check_filter)]
    log_level: String,
    /// Logs as JSON lines.
    #[arg(long, global = true)]
    log_json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Who may connect, and how: TLS and the client allow-list.
#[derive(Args)]
struct Access {
    /// TLS: off (STARTTLS refused), on (offered), require (nothing but
    /// STARTTLS before TLS).
    #[arg(long, default_value = "off", value_name = "off|on|require")]
    tls: TlsMode,
    /// X.509: DIR holds server-cert.pem, server-key.pem and, to require
    /// client certificates, ca-cert.pem.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    tls_certificates: Option<PathBuf>,
    /// TLS-PSK: FILE holds IDENTITY:HEXKEY lines (psktool's format).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Serve only clients from ADDR[/PREFIX] (repeatable; TCP listeners;
    /// default: everyone).
    #[arg(long = "allow", value_name = "ADDR[/PREFIX]")]
    allow: Vec<String>,
}

impl Access {
    fn config(&self, exports: Exports, listen: &str) -> Result<ServerConfig> {
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
        })
    }
}

#[derive(Subcommand)]
enum Cmd {
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
        /// Control socket for status/pause/resume/cutover.
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

fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: f64 = num.parse().with_context(|| format!("bad size {s:?}"))?;
    Ok((n * mul as f64) as u64)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    kemari_logging::init(&cli.log_level, cli.log_json)?;
    let result = run(cli.cmd);
    // A control socket's owner lives on a thread that never ends.
    shutdown::remove_sockets();
    result
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Serve {
            exports,
            listen,
            access,
        } => {
            let mut ex = Exports::new();
            for spec in &exports {
                let (name, rest) = spec
                    .split_once('=')
                    .with_context(|| format!("--export {spec:?}: expected NAME=PATH[,ro]"))?;
                let (path, ro) = match rest.strip_suffix(",ro") {
                    Some(p) => (p, true),
                    None => (rest, false),
                };
                let b = FileBackend::open(path.as_ref(), ro)
                    .with_context(|| format!("opening export {name} at {path}"))?;
                tracing::info!(export = name, path, read_only = ro, "export");
                ex.add(name, Arc::new(b));
            }
            let config = access.config(ex, &listen)?;
            shutdown::exit_on_signals().context("installing the signal handler")?;
            let l = Listener::bind(&listen).with_context(|| format!("--listen {listen}"))?;
            tracing::info!(%listen, tls = ?config.tls.mode(), "target serving");
            kemari_nbd::notify::ready("target", &listen);
            serve(l, Arc::new(config))?;
        }
        Cmd::Proxy {
            upstream,
            cache,
            export,
            listen,
            access,
            control: ctl,
            rate_limit,
            bg_window,
            bg_window_busy,
            no_background,
            no_auto_cutover,
        } => {
            let url = parse_url(&upstream)?;
            let mut cfg = ProxyConfig::new(url, &cache);
            cfg.rate_limit = rate_limit.as_deref().map(parse_size).transpose()?;
            cfg.bg_window = parse_size(&bg_window)?.max(4096);
            cfg.bg_window_busy = match bg_window_busy {
                Some(b) => parse_size(&b)?.max(4096),
                None => (cfg.bg_window / 2).max(128 << 10),
            };
            cfg.background = !no_background;
            cfg.auto_cutover = !no_auto_cutover;
            // Checked before anything starts.
            let mut config = access.config(Exports::new(), &listen)?;
            shutdown::exit_on_signals().context("installing the signal handler")?;
            let l = Listener::bind(&listen).with_context(|| format!("--listen {listen}"))?;
            let ctl = ctl
                .map(|c| control::bind(&c).with_context(|| format!("--control {}", c.display())))
                .transpose()?;
            let proxy = Arc::new(Proxy::start(cfg)?);
            if let Some(c) = ctl {
                c.serve(proxy.clone())?;
            }
            config.exports.add(&export, proxy);
            tracing::info!(%listen, %upstream, tls = ?config.tls.mode(), "proxy serving");
            kemari_nbd::notify::ready("proxy", &listen);
            serve(l, Arc::new(config))?;
        }
        Cmd::Status { control: c } => print(control::request(&c, "status")?)?,
        Cmd::Pause { control: c } => print(control::request(&c, "pause")?)?,
        Cmd::Resume { control: c } => print(control::request(&c, "resume")?)?,
        Cmd::Cutover { control: c, wait } => {
            let mut v = control::request(&c, "cutover")?;
            while wait && v["status"]["cut_over"] != true {
                if v["ok"] != true {
                    bail!("cutover failed: {v}");
                }
                std::thread::sleep(Duration::from_millis(200));
                v = control::request(&c, "status")?;
            }
            print(v)?
        }
        Cmd::AccessCounts { url } => {
            let c = query_access_counts(&parse_url(&url)?)?;
            kemari_logging::stdout::write(|w| {
                writeln!(w, "group_size {}", c.group_size)?;
                for (i, (r, wr)) in c.groups.iter().enumerate() {
                    writeln!(w, "{i} {r} {wr}")?;
                }
                Ok(())
            })?;
        }
        Cmd::RandomReads {
            url,
            blocks,
            secs,
            threads,
        } => {
            let text = std::fs::read_to_string(&blocks)
                .with_context(|| format!("reading {}", blocks.display()))?;
            let list: Vec<u64> = text
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            let r = kemari_nbd::loadgen::random_reads(&url, &list, secs, threads)?;
            kemari_logging::stdout::line(&serde_json::to_string(&r)?)?;
        }
        Cmd::Relay {
            listen,
            to,
            delay_ms,
        } => relay::run(&listen, &to, Duration::from_millis(delay_ms))?,
    }
    Ok(())
}

fn print(v: serde_json::Value) -> Result<()> {
    kemari_logging::stdout::line(&serde_json::to_string_pretty(&v)?)?;
    if v["ok"] != true {
        bail!("request failed");
    }
    Ok(())
}
