//! `kemari-nbd`: NBD target server, relocation proxy and their control CLI.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;

use kemari_nbd::backend::FileBackend;
use kemari_nbd::cli::{Cli, Cmd};
use kemari_nbd::proxy::{Proxy, ProxyConfig};
use kemari_nbd::server::{serve, Exports, Listener};
use kemari_nbd::{control, metrics, relay, shutdown, watch};
use nbd_client::client::{parse_url, query_access_counts};

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
    metrics::init();
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
            // The metrics endpoint first: once the NBD port answers, so does it.
            if let Some(m) = access.metrics_listener()? {
                let render = || (metrics::CONTENT_TYPE, metrics::exposition("target", None));
                m.serve(Arc::new(render), || {})?;
            }
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
            // The control socket and the metrics endpoint are bound before the
            // NBD port: once that answers, they do too (requests wait in
            // their backlogs until the proxy serves them, below).
            let ctl = ctl
                .map(|c| control::bind(&c).with_context(|| format!("--control {}", c.display())))
                .transpose()?;
            let metrics_listener = access.metrics_listener()?;
            let l = Listener::bind(&listen).with_context(|| format!("--listen {listen}"))?;
            let proxy = Arc::new(Proxy::start(cfg)?);
            if let Some(c) = ctl {
                c.serve(proxy.clone())?;
            }
            if let Some(m) = metrics_listener {
                let p = proxy.clone();
                m.serve(
                    Arc::new(move || (metrics::CONTENT_TYPE, p.exposition())),
                    || {},
                )?;
            }
            config.exports.add(&export, proxy);
            tracing::info!(%listen, %upstream, tls = ?config.tls.mode(), "proxy serving");
            kemari_nbd::notify::ready("proxy", &listen);
            serve(l, Arc::new(config))?;
        }
        Cmd::Status {
            control: c,
            watch: false,
        } => print(control::request(&c, "status")?)?,
        Cmd::Status {
            control: c,
            watch: true,
        } => watch::run(&c)?,
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
