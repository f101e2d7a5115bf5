//! `disk=write,<blocks>,seq|rand[,flush][,burst=<n>/<ms>]` and
//! `disk=verify,<blocks>`: the basis of "no acknowledged write lost" tests.
//!
//! `write` writes blocks 0..n in the self-checking format of
//! `guest::blockfmt`, sequentially or in a pseudo-random permutation, up to
//! `blk::DEPTH` requests in flight — or, with `flush`, one at a time, each
//! write followed by a flush and counted as acknowledged only when the flush
//! completed. With `burst`, writes go out `n` at a time every `ms`
//! milliseconds, like an OS writing its file cache back. Every 1000 acknowledged writes it prints
//! `disk: acked=<n> last_block=<b>`, then `disk: write done blocks=<n>`.
//! `verify` reads blocks 0..n back and prints `disk: verify ok blocks=<n>` or
//! `disk: verify FAILED missing=<m> corrupt=<c>` (the first bad blocks are
//! listed as `disk: bad block=<b> missing|corrupt`).

use guest::blockfmt::{self, block_at, BlockState};
use guest::cmdline::{DiskJob, Order};

use crate::exit::{exit, ExitCode};
use crate::say;
use crate::virtio::blk::{Blk, Op, DEPTH};

const PROGRESS_EVERY: u64 = 1000;
const BAD_BLOCKS_LISTED: u64 = 8;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Idle,
    Writing { block: u64 },
    Flushing { block: u64 },
    Reading { block: u64 },
}

/// Runs the `disk=` jobs one after the other.
pub struct DiskRunner {
    jobs: [Option<DiskJob>; guest::cmdline::MAX_DISK_JOBS],
    current: usize,
    slots: [Slot; DEPTH],
    issued: u64,
    completed: u64,
    missing: u64,
    corrupt: u64,
    started_ms: u64,
    failed: bool,
    warned_no_flush: bool,
    continue_on_error: bool,
    /// Paced jobs: blocks the current burst may still issue, and when the
    /// next burst starts.
    burst_left: u64,
    next_burst_ms: u64,
    /// Lowest and highest sequence numbers the current verify read.
    seq_seen: Option<(u64, u64)>,
    /// Highest sequence number the last verify read (for `next`).
    last_seq: Option<u64>,
    /// First sequence number of the current write.
    seq_base: u64,
}

impl DiskRunner {
    pub fn new(cfg: &guest::cmdline::Config, blk: &Blk, now_ms: u64) -> Self {
        for job in cfg.disk_jobs() {
            let blocks = match job {
                DiskJob::Write { blocks, .. } | DiskJob::Verify { blocks } => blocks,
            };
            if blocks > blk.capacity_blocks() {
                say!(
                    "disk: error: {} blocks asked, the disk at {:#x} holds {}",
                    blocks,
                    blk.base(),
                    blk.capacity_blocks()
                );
                exit(ExitCode::DeviceError);
            }
        }
        let mut runner = Self {
            jobs: cfg.disk_jobs,
            current: 0,
            slots: [Slot::Idle; DEPTH],
            issued: 0,
            completed: 0,
            missing: 0,
            corrupt: 0,
            started_ms: now_ms,
            failed: false,
            warned_no_flush: false,
            continue_on_error: cfg.disk_errors_continue,
            burst_left: 0,
            next_burst_ms: now_ms,
            seq_seen: None,
            last_seq: None,
            seq_base: 0,
        };
        runner.announce();
        runner
    }

    /// All jobs finished.
    pub fn done(&self) -> bool {
        self.job().is_none()
    }

    /// A verify found missing or corrupt blocks.
    pub fn failed(&self) -> bool {
        self.failed
    }

    fn job(&self) -> Option<DiskJob> {
        self.jobs.get(self.current).copied().flatten()
    }

    fn announce(&mut self) {
        self.seq_base = 0;
        if let Some(DiskJob::Write { next: true, .. }) = self.job() {
            self.seq_base = self.last_seq.map_or(0, |s| s + 1);
            say!("disk: write seq from={}", self.seq_base);
        }
        match self.job() {
            Some(DiskJob::Write {
                blocks,
                order,
                flush,
                ..
            }) => say!(
                "disk: write start blocks={} order={} flush={}",
                blocks,
                if order == Order::Random {
                    "rand"
                } else {
                    "seq"
                },
                if flush { "yes" } else { "no" }
            ),
            Some(DiskJob::Verify { blocks }) => say!("disk: verify start blocks={}", blocks),
            None => {}
        }
    }

    /// Makes progress without blocking: submits what fits, reaps what
    /// completed.
    pub fn poll(&mut self, blk: &mut Blk, now_ms: u64) {
        let Some(job) = self.job() else { return };
        let (blocks, in_flight_max) = match job {
            DiskJob::Write { blocks, flush, .. } => (blocks, if flush { 1 } else { blk.depth() }),
            DiskJob::Verify { blocks } => (blocks, blk.depth()),
        };

        // Submit.
        let burst = match job {
            DiskJob::Write { burst, .. } => burst,
            DiskJob::Verify { .. } => None,
        };
        if let Some(b) = burst {
            if self.burst_left == 0 && now_ms >= self.next_burst_ms {
                self.burst_left = b.blocks;
                self.next_burst_ms = now_ms + b.period_ms;
            }
        }
        let mut submitted = false;
        for slot in 0..in_flight_max {
            if self.issued >= blocks || (burst.is_some() && self.burst_left == 0) {
                break;
            }
            if self.slots[slot] != Slot::Idle {
                continue;
            }
            let next = match job {
                DiskJob::Write { order, .. } => {
                    let block = block_at(order == Order::Random, self.issued, blocks);
                    blockfmt::fill(blk.buffer(slot), block, self.seq_base + self.issued);
                    (Op::Write, Slot::Writing { block })
                }
                DiskJob::Verify { .. } => (Op::Read, Slot::Reading { block: self.issued }),
            };
            let block = match next.1 {
                Slot::Writing { block } | Slot::Reading { block } => block,
                _ => 0,
            };
            if !blk.submit(slot, next.0, block) {
                break;
            }
            self.slots[slot] = next.1;
            self.issued += 1;
            self.burst_left = self.burst_left.saturating_sub(1);
            submitted = true;
        }
        if submitted {
            blk.kick();
        }

        // Reap.
        while let Some((slot, status)) = blk.poll() {
            let state = self.slots[slot];
            if status != 0 {
                say!(
                    "disk: error: request failed status={} slot={}",
                    status,
                    slot
                );
                if self.continue_on_error {
                    say!("disk: jobs abandoned after an I/O error");
                    self.failed = true;
                    self.current = self.jobs.len();
                    return;
                }
                exit(ExitCode::DeviceError);
            }
            self.slots[slot] = Slot::Idle;
            match state {
                Slot::Writing { block } => {
                    let flush = matches!(job, DiskJob::Write { flush: true, .. });
                    if flush && blk.has_flush() {
                        if blk.submit(slot, Op::Flush, 0) {
                            self.slots[slot] = Slot::Flushing { block };
                            blk.kick();
                        }
                    } else {
                        if flush && !self.warned_no_flush {
                            say!("disk: warning: the device offers no flush; writes not flushed");
                            self.warned_no_flush = true;
                        }
                        self.acked(block);
                    }
                }
                Slot::Flushing { block } => self.acked(block),
                Slot::Reading { block } => self.check(blk, slot, block),
                Slot::Idle => {
                    say!("disk: error: completion for idle slot {}", slot);
                    exit(ExitCode::DeviceError);
                }
            }
        }

        if self.completed == blocks {
            self.finish(job, blocks, now_ms);
        }
    }

    fn acked(&mut self, block: u64) {
        self.completed += 1;
        if self.completed.is_multiple_of(PROGRESS_EVERY) {
            say!("disk: acked={} last_block={}", self.completed, block);
        }
    }

    fn check(&mut self, blk: &mut Blk, slot: usize, block: u64) {
        self.completed += 1;
        let state = blockfmt::check(blk.buffer(slot), block);
        let what = match state {
            BlockState::Valid { seq } => {
                self.seq_seen = Some(match self.seq_seen {
                    None => (seq, seq),
                    Some((lo, hi)) => (lo.min(seq), hi.max(seq)),
                });
                return;
            }
            BlockState::Missing => {
                self.missing += 1;
                "missing"
            }
            BlockState::Corrupt => {
                self.corrupt += 1;
                "corrupt"
            }
        };
        if self.missing + self.corrupt <= BAD_BLOCKS_LISTED {
            say!("disk: bad block={} {}", block, what);
        }
    }

    fn finish(&mut self, job: DiskJob, blocks: u64, now_ms: u64) {
        let ms = now_ms.saturating_sub(self.started_ms);
        match job {
            DiskJob::Write { .. } => {
                say!("disk: write done blocks={}", blocks);
            }
            DiskJob::Verify { .. } => {
                if let Some((lo, hi)) = self.seq_seen.take() {
                    say!("disk: verify seq min={} max={}", lo, hi);
                    self.last_seq = Some(hi);
                }
                if self.missing + self.corrupt == 0 {
                    say!("disk: verify ok blocks={}", blocks);
                } else {
                    say!(
                        "disk: verify FAILED missing={} corrupt={}",
                        self.missing,
                        self.corrupt
                    );
                    self.failed = true;
                }
            }
        }
        say!(
            "disk: job took ms={} blocks_per_s={}",
            ms,
            blocks * 1000 / ms.max(1)
        );
        self.current += 1;
        self.issued = 0;
        self.completed = 0;
        self.missing = 0;
        self.corrupt = 0;
        self.started_ms = now_ms;
        self.burst_left = 0;
        self.next_burst_ms = now_ms;
        self.announce();
    }
}
