//! A small load generator for the WAN benchmark: random 4 KiB reads of a
//! given set of blocks (for example the blocks of the files in an ext4
//! image, as the paper's random file access does), one synchronous request
//! per thread, with ops/s per second of the run.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use nbd_client::client::{Client, ClientError};

#[derive(Debug, Serialize)]
pub struct LoadResult {
    pub ops: u64,
    pub secs: f64,
    pub ops_per_sec: f64,
    /// Operations completed in each second of the run.
    pub timeline: Vec<u64>,
}

/// Reads random blocks from `blocks` (4 KiB block numbers) for `secs`
/// seconds with `threads` connections, one request in flight on each.
pub fn random_reads(
    url: &str,
    blocks: &[u64],
    secs: u64,
    threads: usize,
) -> Result<LoadResult, ClientError> {
    if blocks.is_empty() {
        return Err(ClientError::Unexpected("no blocks to read"));
    }
    let clients = (0..threads.max(1))
        .map(|_| Client::connect(url))
        .collect::<Result<Vec<_>, _>>()?;
    let timeline: Arc<Vec<AtomicU64>> =
        Arc::new((0..secs + 2).map(|_| AtomicU64::new(0)).collect());
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let err = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (timeline, stop) = (&timeline, &stop);
                s.spawn(move || -> Result<(), ClientError> {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1).wrapping_mul(0xff51_afd7);
                    let mut buf = [0u8; 4096];
                    while !stop.load(Ordering::Relaxed) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let b = blocks[(x % blocks.len() as u64) as usize];
                        c.read_at(b * 4096, &mut buf)?;
                        let sec = start.elapsed().as_secs() as usize;
                        if let Some(t) = timeline.get(sec) {
                            t.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Err(ClientError::Closed)))
            .find(|r| r.is_err())
    });
    if let Some(Err(e)) = err {
        return Err(e);
    }
    let t: Vec<u64> = timeline
        .iter()
        .take(secs as usize)
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    let ops: u64 = t.iter().sum();
    Ok(LoadResult {
        ops,
        secs: secs as f64,
        ops_per_sec: ops as f64 / secs as f64,
        timeline: t,
    })
}
