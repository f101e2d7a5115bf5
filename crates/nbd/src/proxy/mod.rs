//! The relocation proxy: serves an export whose blocks are fetched from an
//! upstream target (or proxy) on first access and copied in the background,
//! until everything is local and the upstream is cut off.
//!
//! - reads of cached blocks and all writes are served locally;
//! - a read of uncached blocks fetches them upstream (on-demand link,
//!   coalesced, many in flight), stores them, then answers;
//! - a sub-block write to an uncached block fetches that block first;
//! - the background copy ([`background`]) fills in the rest at low priority;
//! - the cache survives a crash ([`cache`] documents the write ordering).

pub mod background;
pub mod cache;
pub mod fetch;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use thiserror::Error;
use tracing::{info, warn};

use crate::backend::{file_extents, push_extent, AccessCounters, Backend, Extent};
use cache::{Cache, CacheError, BLOCK};
use fetch::{FetchStats, Link, OnDemand};
use nbd_client::client::{Client, ClientError, NbdUrl};
use nbd_client::protocol::{AccessCounts, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES};

#[derive(Debug, Error)]
pub enum ProxyError {
    #[error("cannot reach upstream {url}")]
    Upstream {
        url: String,
        #[source]
        source: ClientError,
    },
    #[error("opening the cache")]
    Cache(#[from] CacheError),
}

/// Proxy settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub upstream: NbdUrl,
    pub cache_dir: std::path::PathBuf,
    /// Background bytes in flight when no client fetch is waiting.
    pub bg_window: u64,
    /// Background bytes in flight while a client fetch is waiting.
    pub bg_window_busy: u64,
    /// Background copy rate limit in bytes/s.
    pub rate_limit: Option<u64>,
    pub background: bool,
    pub auto_cutover: bool,
    /// Cache bitmap persist interval.
    pub persist_interval: Duration,
}

impl ProxyConfig {
    pub fn new(upstream: NbdUrl, cache_dir: &Path) -> Self {
        ProxyConfig {
            upstream,
            cache_dir: cache_dir.to_path_buf(),
            bg_window: 1 << 20,
            bg_window_busy: 512 << 10,
            rate_limit: None,
            background: true,
            auto_cutover: true,
            persist_interval: Duration::from_millis(200),
        }
    }
}

/// State shared by the proxy's threads.
pub struct Shared {
    pub upstream: NbdUrl,
    pub cache: Cache,
    pub ondemand: OnDemand,
    pub bg_link: Link,
    pub stats: Arc<FetchStats>,
    pub counters: AccessCounters,
    pub paused: AtomicBool,
    pub force_cutover: AtomicBool,
    pub cut_over: AtomicBool,
    pub auto_cutover: bool,
    pub bg_window: u64,
    pub bg_window_busy: u64,
    pub rate_limit: Option<u64>,
    /// Token bucket for the rate limit: (tokens, last refill).
    pub bucket: Mutex<(f64, Instant)>,
    pub phase: Mutex<&'static str>,
    /// Client reads served from the cache alone, and those that fetched.
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    rates: Mutex<Rates>,
    started: Instant,
}

#[derive(Default, Clone, Copy)]
struct Rates {
    at: Option<Instant>,
    ondemand_bytes: u64,
    background_bytes: u64,
    ondemand_rate: f64,
    background_rate: f64,
}

impl Shared {
    /// Reads through the cache, fetching what is missing (used by the copy
    /// planner and by client reads).
    pub fn read_through(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if !buf.is_empty() && !self.cut_over.load(Ordering::Acquire) {
            let len = buf.len() as u64;
            if !self.cache.range_cached(offset, len) {
                self.ondemand
                    .ensure(&self.cache, offset / BLOCK, (offset + len - 1) / BLOCK)
                    .map_err(io::Error::other)?;
            }
        }
        self.cache.read_at(buf, offset)
    }

    /// Fetches the partially covered, uncached first and last blocks of a write.
    fn prepare_write(&self, offset: u64, len: u64) -> io::Result<()> {
        if len == 0 || self.cut_over.load(Ordering::Acquire) {
            return Ok(());
        }
        let (first, last) = (offset / BLOCK, (offset + len - 1) / BLOCK);
        let end = offset + len;
        let size = self.cache.size();
        let partial = |b: u64| {
            let (bs, be) = (b * BLOCK, ((b + 1) * BLOCK).min(size));
            offset > bs || end < be
        };
        for b in [first, last] {
            if partial(b) && !self.cache.is_cached(b) {
                self.ondemand
                    .ensure(&self.cache, b, b)
                    .map_err(io::Error::other)?;
            }
        }
        Ok(())
    }

    /// Disconnects upstream; from now on the proxy is a plain target.
    pub fn cutover(&self) {
        if !self.cache.complete() {
            warn!("cut-over refused: not every block is cached");
            return;
        }
        if let Err(e) = self.cache.persist() {
            warn!(error = %e, "persist before cut-over failed; not cutting over");
            return;
        }
        self.cut_over.store(true, Ordering::Release);
        self.ondemand.link.close();
        self.bg_link.close();
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = "cut-over";
        info!(upstream = %self.upstream, "cut-over: every block is local; upstream disconnected");
    }

    pub fn status(&self) -> Status {
        let s = &self.stats;
        let ob = s.ondemand_bytes.load(Ordering::Relaxed);
        let bb = s.background_bytes.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut r = self.rates.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = r.at {
            let dt = now.duration_since(at).as_secs_f64();
            if dt >= 0.2 {
                r.ondemand_rate = (ob - r.ondemand_bytes) as f64 / dt;
                r.background_rate = (bb - r.background_bytes) as f64 / dt;
                *r = Rates {
                    at: Some(now),
                    ondemand_bytes: ob,
                    background_bytes: bb,
                    ..*r
                };
            }
        } else {
            *r = Rates {
                at: Some(now),
                ondemand_bytes: ob,
                background_bytes: bb,
                ..*r
            };
        }
        let cached = self.cache.cached_blocks();
        let total = self.cache.nblocks();
        Status {
            upstream: self.upstream.to_string(),
            phase: *self.phase.lock().unwrap_or_else(|e| e.into_inner()),
            size: self.cache.size(),
            blocks: total,
            cached_blocks: cached,
            cached_percent: if total == 0 {
                100.0
            } else {
                cached as f64 * 100.0 / total as f64
            },
            paused: self.paused.load(Ordering::Relaxed),
            cut_over: self.cut_over.load(Ordering::Relaxed),
            ondemand_bytes: ob,
            ondemand_requests: s.ondemand_requests.load(Ordering::Relaxed),
            background_bytes: bb,
            ondemand_rate_bytes_per_sec: r.ondemand_rate,
            background_rate_bytes_per_sec: r.background_rate,
            ondemand_queue_depth: s.ondemand_inflight.load(Ordering::Relaxed),
            background_queue_depth: s.background_inflight.load(Ordering::Relaxed),
            uptime_secs: self.started.elapsed().as_secs_f64(),
        }
    }
}

/// What `kemari-nbd status` prints.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Status {
    pub upstream: String,
    pub phase: &'static str,
    pub size: u64,
    pub blocks: u64,
    pub cached_blocks: u64,
    pub cached_percent: f64,
    pub paused: bool,
    pub cut_over: bool,
    pub ondemand_bytes: u64,
    pub ondemand_requests: u64,
    pub background_bytes: u64,
    pub ondemand_rate_bytes_per_sec: f64,
    pub background_rate_bytes_per_sec: f64,
    pub ondemand_queue_depth: u64,
    pub background_queue_depth: u64,
    pub uptime_secs: f64,
}

/// The proxy as an export backend.
pub struct Proxy {
    pub shared: Arc<Shared>,
}

impl Proxy {
    /// Connects upstream, opens the cache and starts the background threads.
    /// If upstream is unreachable but the cache is complete (a restart after
    /// cut-over), the proxy starts as a plain target.
    pub fn start(cfg: ProxyConfig) -> Result<Proxy, ProxyError> {
        let stats = Arc::new(FetchStats::default());
        let first = Client::connect_url(&cfg.upstream);
        let (size, client) = match first {
            Ok(c) => (c.size(), Some(c)),
            Err(source) => match cache::existing_size(&cfg.cache_dir) {
                Some(size) => (size, None),
                None => {
                    return Err(ProxyError::Upstream {
                        url: cfg.upstream.to_string(),
                        source,
                    })
                }
            },
        };
        let cache = Cache::open(&cfg.cache_dir, size)?;
        if client.is_none() && !cache.complete() {
            return Err(ProxyError::Upstream {
                url: cfg.upstream.to_string(),
                source: ClientError::Closed,
            });
        }
        info!(
            size,
            cached_blocks = cache.cached_blocks(),
            blocks = cache.nblocks(),
            "proxy cache opened"
        );
        let od_link = Link::new(cfg.upstream.clone(), "on-demand");
        if let Some(c) = client {
            od_link.set(c);
        }
        let shared = Arc::new(Shared {
            upstream: cfg.upstream.clone(),
            counters: AccessCounters::new(size),
            cache,
            ondemand: OnDemand::new(od_link, stats.clone()),
            bg_link: Link::new(cfg.upstream.clone(), "background"),
            stats,
            paused: AtomicBool::new(!cfg.background),
            force_cutover: AtomicBool::new(false),
            cut_over: AtomicBool::new(false),
            auto_cutover: cfg.auto_cutover,
            bg_window: cfg.bg_window,
            bg_window_busy: cfg.bg_window_busy,
            rate_limit: cfg.rate_limit,
            bucket: Mutex::new((0.0, Instant::now())),
            phase: Mutex::new("planning"),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            rates: Mutex::new(Rates::default()),
            started: Instant::now(),
        });
        // Periodic persist of the bitmap.
        let sh = Arc::downgrade(&shared);
        let every = cfg.persist_interval;
        std::thread::Builder::new()
            .name("nbd-persist".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                let Some(sh) = sh.upgrade() else { break };
                if sh.cache.is_dirty() {
                    if let Err(e) = sh.cache.persist() {
                        warn!(error = %e, "persisting the cache bitmap failed");
                    }
                }
            })
            .map_err(CacheError::Io)?;
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("nbd-bgcopy".into())
            .spawn(move || background::run(sh))
            .map_err(CacheError::Io)?;
        Ok(Proxy { shared })
    }

    /// What the proxy adds to `GET /metrics`.
    pub fn metrics_view(&self) -> crate::metrics::ProxyView {
        crate::metrics::ProxyView {
            status: self.shared.status(),
            cache_hits: self.shared.cache_hits.load(Ordering::Relaxed),
            cache_misses: self.shared.cache_misses.load(Ordering::Relaxed),
        }
    }

    /// The exposition of a proxy's metrics now.
    pub fn exposition(&self) -> String {
        crate::metrics::exposition("proxy", Some(&self.metrics_view()))
    }

    pub fn pause(&self, paused: bool) {
        self.shared.paused.store(paused, Ordering::Release);
        info!(paused, "background copy");
    }

    /// Cuts over now if complete; otherwise copies the rest at full speed
    /// (ignoring pause and rate limit) and cuts over when done.
    pub fn force_cutover(&self) {
        self.shared.force_cutover.store(true, Ordering::Release);
        if self.shared.cache.complete() {
            self.shared.cutover();
        }
    }
}

impl Backend for Proxy {
    fn size(&self) -> u64 {
        self.shared.cache.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let sh = &self.shared;
        sh.counters.record(offset, buf.len() as u64, false);
        let hit =
            sh.cut_over.load(Ordering::Acquire) || sh.cache.range_cached(offset, buf.len() as u64);
        let tally = if hit {
            &sh.cache_hits
        } else {
            &sh.cache_misses
        };
        tally.fetch_add(1, Ordering::Relaxed);
        sh.read_through(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let sh = &self.shared;
        sh.counters.record(offset, data.len() as u64, true);
        sh.prepare_write(offset, data.len() as u64)?;
        sh.cache.write_at(data, offset)?;
        if fua {
            sh.cache.persist()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.shared.cache.persist()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        // Trim is advisory: drop whole blocks only (they read back as zeroes).
        let start = offset.div_ceil(BLOCK) * BLOCK;
        let end = ((offset + len) / BLOCK * BLOCK).max(start);
        let end = if offset + len == self.size() {
            self.size()
        } else {
            end
        };
        if end > start {
            self.shared.cache.zero(start, end - start, true)?;
        }
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, fua: bool) -> io::Result<()> {
        let sh = &self.shared;
        sh.counters.record(offset, len, true);
        sh.prepare_write(offset, len)?;
        sh.cache.zero(offset, len, may_trim)?;
        if fua {
            sh.cache.persist()?;
        }
        Ok(())
    }
    /// What the cache knows: the holes of cached blocks are those of the
    /// cache file (trimmed or never written); an uncached block is data, as
    /// it may hold anything upstream. Nothing is asked upstream, so a map
    /// becomes exact as the copy completes.
    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent>> {
        let cache = &self.shared.cache;
        let end = offset.saturating_add(len).min(cache.size());
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < max {
            let cached = cache.is_cached(pos / BLOCK);
            let mut next = (pos / BLOCK + 1) * BLOCK;
            while next < end && cache.is_cached(next / BLOCK) == cached {
                next += BLOCK;
            }
            let next = next.min(end);
            if cached {
                let found = file_extents(cache.file(), pos, next - pos, max - out.len())?;
                let covered: u64 = found.iter().map(|e| e.len).sum();
                for e in found {
                    push_extent(&mut out, e);
                }
                if covered < next - pos {
                    // Out of extents: the reply covers less, as allowed.
                    break;
                }
            } else {
                push_extent(
                    &mut out,
                    Extent {
                        len: next - pos,
                        hole: false,
                    },
                );
            }
            pos = next;
        }
        Ok(out)
    }
    fn access_counts(&self) -> Option<AccessCounts> {
        Some(self.shared.counters.snapshot())
    }
    fn read_cached(&self, buf: &mut [u8], offset: u64) -> bool {
        let sh = &self.shared;
        let len = buf.len() as u64;
        let local = sh.cut_over.load(Ordering::Acquire) || sh.cache.range_cached(offset, len);
        let ok = local && crate::backend::read_cached_at(sh.cache.file(), buf, offset);
        if ok {
            sh.counters.record(offset, len, false);
            sh.cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
    fn write_via_file(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        fill: &mut dyn FnMut(&std::fs::File) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        // Only where every block is cached already: then the write changes
        // no bit, and it is the same in-place write as `Cache::write_at`.
        let sh = &self.shared;
        if !sh.cache.range_cached(offset, len) {
            return None;
        }
        sh.counters.record(offset, len, true);
        Some(fill(sh.cache.file()).and_then(|()| {
            if fua {
                sh.cache.persist()?;
            }
            Ok(())
        }))
    }
    fn may_block(&self, command: u16, offset: u64, len: u32) -> bool {
        matches!(command, CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES)
            && !self.shared.cut_over.load(Ordering::Relaxed)
            && !self.shared.cache.range_cached(offset, u64::from(len))
    }
}
