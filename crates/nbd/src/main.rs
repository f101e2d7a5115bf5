//! `kemari-nbd`: NBD target server, relocation proxy and their control CLI.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use kemari_nbd::backend::FileBackend;
use kemari_nbd::proxy::{Proxy, ProxyConfig};
use kemari_nbd::server::{serve, Exports, Listener};
use kemari_nbd::{control, relay};
use nbd_client::client::{parse_url, query_access_counts};

#[derive(Parser)]
#[command(name = "kemari-nbd", about = "NBD target server and relocation proxy")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
        #[arg(long, default_value = "127.0.0.1:10810")]
        listen: String,
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve { exports, listen } => {
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
            let l = Listener::bind(&listen).with_context(|| format!("listening on {listen}"))?;
            tracing::info!(%listen, "target serving");
            serve(l, Arc::new(ex))?;
        }
        Cmd::Proxy {
            upstream,
            cache,
            export,
            listen,
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
            let proxy = Arc::new(Proxy::start(cfg)?);
            if let Some(c) = ctl {
                control::spawn(&c, proxy.clone())
                    .with_context(|| format!("control socket {}", c.display()))?;
            }
            let mut ex = Exports::new();
            ex.add(&export, proxy);
            let l = Listener::bind(&listen).with_context(|| format!("listening on {listen}"))?;
            tracing::info!(%listen, %upstream, "proxy serving");
            serve(l, Arc::new(ex))?;
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
            println!("group_size {}", c.group_size);
            for (i, (r, w)) in c.groups.iter().enumerate() {
                println!("{i} {r} {w}");
            }
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
            println!("{}", serde_json::to_string(&r)?);
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
    println!("{}", serde_json::to_string_pretty(&v)?);
    if v["ok"] != true {
        bail!("request failed");
    }
    Ok(())
}
