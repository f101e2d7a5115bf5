//! Upstream links and on-demand fetching.
//!
//! The proxy keeps two upstream connections: the *on-demand* link carries
//! only fetches that a client is waiting for, the *background* link carries
//! the background copy, whose window of requests in flight shrinks while any
//! on-demand fetch is outstanding. This is the async equivalent of the
//! paper's two queues (the priority queue is always served first): an
//! on-demand fetch never waits behind queued background requests, neither in
//! the proxy nor in the target's per-connection request order.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tracing::{info, warn};

use super::cache::{Cache, BLOCK};
use nbd_client::client::{Client, ClientError, NbdUrl};
use nbd_client::protocol::CMD_READ;

/// Largest single upstream read (blocks are coalesced up to this size).
pub const MAX_FETCH: u64 = 256 * 1024;

/// A lazily (re)connected upstream connection.
pub struct Link {
    url: NbdUrl,
    client: Mutex<Option<Arc<Client>>>,
    name: &'static str,
}

impl Link {
    pub fn new(url: NbdUrl, name: &'static str) -> Self {
        Link {
            url,
            client: Mutex::new(None),
            name,
        }
    }

    pub fn get(&self) -> Result<Arc<Client>, ClientError> {
        let mut g = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = g.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
            warn!(link = self.name, "upstream connection lost; reconnecting");
        }
        let c = Arc::new(Client::connect_url(&self.url)?);
        info!(link = self.name, upstream = %self.url, "connected upstream");
        *g = Some(c.clone());
        Ok(c)
    }

    pub fn set(&self, c: Client) {
        *self.client.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(c));
    }

    /// Drops the connection (cut-over).
    pub fn close(&self) {
        self.client.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// One on-demand fetch in flight; later readers of the same blocks wait on it.
struct InFlight {
    done: Mutex<Option<bool>>,
    cv: Condvar,
}

impl InFlight {
    fn finish(&self, ok: bool) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some(ok);
        self.cv.notify_all();
    }
    fn wait(&self) -> bool {
        let mut g = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.unwrap_or(false)
    }
}

#[derive(Default)]
pub struct FetchStats {
    pub ondemand_bytes: AtomicU64,
    pub ondemand_requests: AtomicU64,
    pub ondemand_inflight: AtomicU64,
    pub background_bytes: AtomicU64,
    pub background_inflight: AtomicU64,
}

pub struct OnDemand {
    pub link: Link,
    inflight: Mutex<HashMap<u64, Arc<InFlight>>>,
    pub stats: Arc<FetchStats>,
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching blocks {first}..{end} from upstream")]
    Upstream {
        first: u64,
        end: u64,
        #[source]
        source: ClientError,
    },
    #[error("storing fetched blocks in the cache")]
    Cache(#[from] std::io::Error),
    #[error("blocks still uncached after retries")]
    Retries,
}

impl OnDemand {
    pub fn new(link: Link, stats: Arc<FetchStats>) -> Self {
        OnDemand {
            link,
            inflight: Mutex::new(HashMap::new()),
            stats,
        }
    }

    /// Makes blocks `first..=last` cached, fetching the missing ones upstream
    /// (coalesced, all in flight at once) and waiting for fetches other
    /// requests already started.
    pub fn ensure(&self, cache: &Cache, first: u64, last: u64) -> Result<(), FetchError> {
        for _attempt in 0..3 {
            let mut runs: Vec<(u64, u64, Arc<InFlight>)> = Vec::new();
            let mut waits: Vec<Arc<InFlight>> = Vec::new();
            {
                let mut map = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
                let mut b = first;
                while b <= last {
                    if cache.is_cached(b) {
                        b += 1;
                        continue;
                    }
                    if let Some(f) = map.get(&b) {
                        if !waits.iter().any(|w| Arc::ptr_eq(w, f)) {
                            waits.push(f.clone());
                        }
                        b += 1;
                        continue;
                    }
                    let f = Arc::new(InFlight {
                        done: Mutex::new(None),
                        cv: Condvar::new(),
                    });
                    let start = b;
                    while b <= last
                        && b - start < MAX_FETCH / BLOCK
                        && !cache.is_cached(b)
                        && !map.contains_key(&b)
                    {
                        map.insert(b, f.clone());
                        b += 1;
                    }
                    runs.push((start, b, f));
                }
            }
            if runs.is_empty() && waits.is_empty() {
                return Ok(());
            }
            let result = self.fetch_runs(cache, &runs);
            {
                let mut map = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
                for (s, e, _) in &runs {
                    for b in *s..*e {
                        map.remove(&b);
                    }
                }
            }
            let ok = result.is_ok();
            for (_, _, f) in &runs {
                f.finish(ok);
            }
            result?;
            for w in waits {
                w.wait();
            }
            if (first..=last).all(|b| cache.is_cached(b)) {
                return Ok(());
            }
        }
        Err(FetchError::Retries)
    }

    fn fetch_runs(
        &self,
        cache: &Cache,
        runs: &[(u64, u64, Arc<InFlight>)],
    ) -> Result<(), FetchError> {
        let err = |first, end, source| FetchError::Upstream { first, end, source };
        let n = runs.len() as u64;
        self.stats.ondemand_inflight.fetch_add(n, Ordering::Relaxed);
        let res = (|| {
            let mut tickets = Vec::with_capacity(runs.len());
            for (s, e, _) in runs {
                let off = s * BLOCK;
                let len = (e * BLOCK).min(cache.size()) - off;
                let t = self
                    .link
                    .get()
                    .and_then(|c| c.submit(CMD_READ, 0, off, len as u32, &[]))
                    .map_err(|source| err(*s, *e, source));
                tickets.push(t);
            }
            for ((s, e, _), t) in runs.iter().zip(tickets) {
                // One retry on a fresh connection if the link broke.
                let data = match t.and_then(|t| t.wait().map_err(|source| err(*s, *e, source))) {
                    Ok(d) => d,
                    Err(first_err) => {
                        warn!(error = %first_err, "on-demand fetch failed; retrying");
                        let off = s * BLOCK;
                        let len = (e * BLOCK).min(cache.size()) - off;
                        self.link
                            .get()
                            .and_then(|c| {
                                let mut v = vec![0u8; len as usize];
                                c.read_at(off, &mut v).map(|_| v)
                            })
                            .map_err(|source| err(*s, *e, source))?
                    }
                };
                self.stats
                    .ondemand_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                self.stats.ondemand_requests.fetch_add(1, Ordering::Relaxed);
                cache.install(*s, &data)?;
            }
            Ok(())
        })();
        self.stats.ondemand_inflight.fetch_sub(n, Ordering::Relaxed);
        res
    }
}
