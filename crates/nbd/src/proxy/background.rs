//! The background copy: fetches every uncached block at low priority, in
//! this order (as in the paper): blocks an ext2/3/4 file system in the image
//! uses, hottest access groups first; then all remaining blocks, hottest
//! groups first. "Hottest" is first the proxy's own clients' accesses (so
//! the copy follows the migrated VM's working set), then the upstream's
//! access counts. When every block is cached it triggers the cut-over.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::cache::{Cache, BLOCK};
use super::Shared;
use crate::ext::{self, UsedBlocks};
use nbd_client::client::{query_access_counts, Ticket};
use nbd_client::protocol::CMD_READ;

/// Size of one background request.
pub const EXTENT: u64 = 128 * 1024;

/// The order in which groups of blocks are copied.
pub struct Plan {
    pub group_blocks: u64,
    pub group_order: Vec<u64>,
    pub used: Option<UsedBlocks>,
}

/// Asks upstream for access counts and parses the file system.
pub fn plan(sh: &Shared) -> Plan {
    let nblocks = sh.cache.nblocks();
    let (group_blocks, mut hot) = match query_access_counts(&sh.upstream) {
        Ok(c) => {
            info!(groups = c.groups.len(), "upstream access counts");
            let gb = (c.group_size / BLOCK).max(1);
            (gb, c.groups.iter().map(|(r, w)| r + w).collect::<Vec<_>>())
        }
        Err(e) => {
            info!(error = %e, "upstream has no access counts; copying in offset order");
            (crate::backend::ACCESS_GROUP_SIZE / BLOCK, Vec::new())
        }
    };
    let ngroups = nblocks.div_ceil(group_blocks);
    hot.resize(ngroups as usize, 0);
    let mut group_order: Vec<u64> = (0..ngroups).collect();
    group_order.sort_by_key(|&g| std::cmp::Reverse(hot[g as usize]));
    let size = sh.cache.size();
    let mut read = |off: u64, buf: &mut [u8]| sh.read_through(buf, off);
    let used = match ext::used_blocks(&mut read, size, BLOCK) {
        Ok(Some(u)) => {
            info!(
                fs_block_size = u.fs_block_size,
                used_fs_blocks = u.used_fs_blocks,
                "ext file system found; copying its used blocks first"
            );
            Some(u)
        }
        Ok(None) => None,
        Err(e) => {
            warn!(error = %e, "could not parse the ext file system; ignoring it");
            None
        }
    };
    Plan {
        group_blocks,
        group_order,
        used,
    }
}

struct Window {
    q: VecDeque<(u64, u64, Result<Ticket, nbd_client::client::ClientError>)>,
    bytes: u64,
    /// Completed, contiguous extents not yet written to the cache.
    pending: Pending,
}

/// Up to this much fetched data is gathered into one write to the cache
/// file: the page cache keeps it in folios of the write's size, and later
/// 1 MiB client transfers through the proxy cost as much as through the
/// target only if the cache file's folios are that large
/// (the benchmark notebook (`git show fd35298:docs/benchmarks.md`), "Proxy writes and the page cache").
const COALESCE: usize = 1 << 20;
/// ... but data is written once it has waited this long (checked as the
/// next extent arrives, or at once when none is in flight), so that clients
/// find it cached soon: over a WAN, where a 1 MiB run takes ~80 ms to
/// arrive, it goes in pieces.
const COALESCE_WAIT: Duration = Duration::from_millis(10);

/// Fetched data waiting to be installed as one run.
#[derive(Default)]
struct Pending {
    first_block: u64,
    data: Vec<u8>,
    since: Option<Instant>,
}

impl Pending {
    /// Adds `data` fetched for blocks from `first_block`, writing out what
    /// was gathered first if `data` does not continue it or there is no
    /// room.
    fn add(&mut self, cache: &Cache, first_block: u64, data: Vec<u8>) {
        let continues = self.since.is_some()
            && self.first_block + (self.data.len() as u64).div_ceil(BLOCK) == first_block
            && (self.data.len() as u64).is_multiple_of(BLOCK)
            && self.data.len() + data.len() <= COALESCE;
        if !continues {
            self.flush(cache);
            self.first_block = first_block;
            self.since = Some(Instant::now());
            self.data = data;
        } else {
            self.data.extend_from_slice(&data);
        }
        if self.data.len() >= COALESCE || self.since.is_some_and(|t| t.elapsed() >= COALESCE_WAIT) {
            self.flush(cache);
        }
    }

    fn flush(&mut self, cache: &Cache) {
        if self.since.take().is_none() {
            return;
        }
        let data = std::mem::take(&mut self.data);
        if let Err(e) = cache.install(self.first_block, &data) {
            warn!(error = %e, "cache write failed in background copy");
        }
    }
}

/// Runs the copy to completion (or until cut-over), then cuts over.
pub fn run(sh: Arc<Shared>) {
    let plan = plan(&sh);
    *sh.phase.lock().unwrap_or_else(|e| e.into_inner()) = "copying";
    let mut win = Window {
        q: VecDeque::new(),
        bytes: 0,
        pending: Pending::default(),
    };
    let mut pass = 0;
    while !sh.cache.complete() && !sh.cut_over.load(Ordering::Acquire) {
        let used_only = pass == 0 && plan.used.is_some();
        let mut done = vec![false; plan.group_order.len()];
        while let Some(g) = next_group(&sh, &plan, &mut done) {
            let start = g * plan.group_blocks;
            let end = ((g + 1) * plan.group_blocks).min(sh.cache.nblocks());
            let wanted = |b: u64| {
                !sh.cache.is_cached(b)
                    && (!used_only || plan.used.as_ref().is_some_and(|u| u.contains(b)))
            };
            let mut b = start;
            while b < end {
                if !wanted(b) {
                    b += 1;
                    continue;
                }
                let s = b;
                while b < end && b - s < EXTENT / BLOCK && wanted(b) {
                    b += 1;
                }
                if !submit(&sh, &mut win, s, b) {
                    drain(&sh, &mut win, 0);
                    return;
                }
            }
        }
        drain(&sh, &mut win, 0);
        pass += 1;
        if pass > 2 && !sh.cache.complete() {
            // Upstream errors left holes: back off before sweeping again.
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    drain(&sh, &mut win, 0);
    if let Err(e) = sh.cache.persist() {
        warn!(error = %e, "persisting the cache bitmap failed");
    }
    info!(
        background_bytes = sh.stats.background_bytes.load(Ordering::Relaxed),
        "background copy complete"
    );
    *sh.phase.lock().unwrap_or_else(|e| e.into_inner()) = "complete";
    while !sh.cut_over.load(Ordering::Acquire) {
        if sh.auto_cutover || sh.force_cutover.load(Ordering::Acquire) {
            sh.cutover();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Groups copied in a dynamic order up to this many (the pick is O(groups)).
const DYNAMIC_GROUPS: usize = 8192;

/// Picks the next group to copy: the one this proxy's own clients have
/// accessed most (so the copy follows the working set after migration),
/// ties broken by the upstream's hotness order.
fn next_group(sh: &Shared, plan: &Plan, done: &mut [bool]) -> Option<u64> {
    let n = plan.group_order.len();
    let pick = if n <= DYNAMIC_GROUPS {
        let local = sh.counters.snapshot();
        let gbytes = plan.group_blocks * BLOCK;
        let heat = |g: u64| {
            let i = (g * gbytes / local.group_size.max(1)) as usize;
            local.groups.get(i).map_or(0, |(r, w)| r + w)
        };
        let mut best: Option<(u64, u64)> = None; // (heat, group)
        for &g in &plan.group_order {
            if done[g as usize] {
                continue;
            }
            let h = heat(g);
            if best.is_none_or(|(bh, _)| h > bh) {
                best = Some((h, g));
            }
        }
        best.map(|(_, g)| g)
    } else {
        plan.group_order
            .iter()
            .copied()
            .find(|&g| !done[g as usize])
    };
    if let Some(g) = pick {
        done[g as usize] = true;
    }
    pick
}

fn window_limit(sh: &Shared) -> u64 {
    if sh.stats.ondemand_inflight.load(Ordering::Relaxed) > 0 {
        sh.bg_window_busy
    } else {
        sh.bg_window
    }
}

/// Sends one extent upstream, after waiting for room in the window, for the
/// rate limit and while paused. Returns false when the copy must stop.
fn submit(sh: &Shared, win: &mut Window, s: u64, e: u64) -> bool {
    let len = (e * BLOCK).min(sh.cache.size()) - s * BLOCK;
    loop {
        if sh.cut_over.load(Ordering::Acquire) {
            return false;
        }
        // Skip if clients fetched it meanwhile.
        if (s..e).all(|b| sh.cache.is_cached(b)) {
            return true;
        }
        let forced = sh.force_cutover.load(Ordering::Acquire);
        if sh.paused.load(Ordering::Acquire) && !forced {
            drain(sh, win, 0);
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let limit = window_limit(sh);
        if win.bytes + len > limit && !win.q.is_empty() {
            drain(sh, win, limit.saturating_sub(len));
            continue;
        }
        if let Some(rate) = sh.rate_limit.filter(|_| !forced) {
            let mut tb = sh.bucket.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let dt = now.duration_since(tb.1).as_secs_f64();
            tb.0 = (tb.0 + dt * rate as f64).min(rate as f64 / 4.0 + len as f64);
            tb.1 = now;
            if tb.0 < len as f64 {
                let wait = (len as f64 - tb.0) / rate as f64;
                drop(tb);
                std::thread::sleep(Duration::from_secs_f64(wait.min(0.1)));
                continue;
            }
            tb.0 -= len as f64;
        }
        break;
    }
    let t = sh
        .bg_link
        .get()
        .and_then(|c| c.submit(CMD_READ, 0, s * BLOCK, len as u32, &[]));
    win.bytes += len;
    sh.stats.background_inflight.fetch_add(1, Ordering::Relaxed);
    win.q.push_back((s, len, t));
    true
}

/// Completes the oldest requests until at most `target` bytes are in flight.
fn drain(sh: &Shared, win: &mut Window, target: u64) {
    while win.bytes > target {
        let Some((s, len, t)) = win.q.pop_front() else {
            win.bytes = 0;
            break;
        };
        win.bytes -= len;
        sh.stats.background_inflight.fetch_sub(1, Ordering::Relaxed);
        match t.and_then(|t| t.wait()) {
            Ok(data) => {
                sh.stats
                    .background_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                win.pending.add(&sh.cache, s, data);
            }
            Err(e) => {
                warn!(error = %e, block = s, "background fetch failed");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    if win.q.is_empty() {
        // Nothing in flight could continue it: write it now (a pass must
        // not end with blocks fetched but not cached).
        win.pending.flush(&sh.cache);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_extents_are_gathered_and_a_gap_or_a_full_run_writes_them() {
        let dir = std::env::temp_dir().join(format!("knbd-pending-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = Cache::open(&dir, 4 << 20).unwrap();
        let extent = |byte: u8| vec![byte; (128 << 10) as usize];
        let blocks = (128 << 10) / BLOCK;
        let mut p = Pending::default();
        // Two contiguous extents wait (nothing cached yet)...
        p.add(&cache, 0, extent(1));
        p.add(&cache, blocks, extent(2));
        if p.since.is_some() {
            assert_eq!(cache.cached_blocks(), 0);
            assert_eq!(p.data.len(), 2 * (128 << 10));
        }
        // ... until one that does not continue them: they are written, and
        // it waits in turn.
        p.add(&cache, 10 * blocks, extent(3));
        assert_eq!(cache.cached_blocks(), 2 * blocks);
        p.flush(&cache);
        assert_eq!(cache.cached_blocks(), 3 * blocks);
        let mut b = vec![0u8; 4096];
        cache.read_at(&mut b, (blocks + 1) * BLOCK).unwrap();
        assert!(b.iter().all(|&x| x == 2));
        cache.read_at(&mut b, 10 * blocks * BLOCK).unwrap();
        assert!(b.iter().all(|&x| x == 3));
        // A full run (COALESCE bytes) is written at once.
        let per_run = COALESCE as u64 / (128 << 10);
        for i in 0..per_run {
            p.add(&cache, 16 * blocks + i * blocks, extent(4));
        }
        assert!(p.since.is_none());
        assert_eq!(cache.cached_blocks(), 3 * blocks + per_run * blocks);
        // Flushing with nothing gathered does nothing.
        p.flush(&cache);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
