//! `pmem=verify` and `pmem=write[,next]`: generations of the whole
//! virtio-pmem window, in the self-checking format of `guest::pmemfmt`, the
//! basis of "the window is the file, and survives a reboot" tests.
//!
//! `verify` checks every word of the window and prints
//! `pmem: read generation <g> ok size=<bytes> ms=<ms>`, or
//! `pmem: verify FAILED …` saying what it found (an empty window, a header
//! of no generation, or the generation and its first damaged byte).
//! `write` writes a generation over the window with plain stores
//! (`pmem: wrote generation <g> size=<bytes> ms=<ms>`), then sends a FLUSH
//! and prints `pmem: flushed generation=<g> ms=<ms>` once it completed, so
//! the generation is in the backing file when that line appears. The jobs
//! run in the order given; verifying and writing are a few milliseconds per
//! MiB, done in one turn of the main loop.

use guest::cmdline::{Config, PmemJob, MAX_PMEM_JOBS};
use guest::pmemfmt::{self, PmemState};

use crate::exit::{exit, ExitCode};
use crate::say;
use crate::virtio::pmem::Pmem;

pub struct PmemRunner {
    jobs: [Option<PmemJob>; MAX_PMEM_JOBS],
    current: usize,
    /// Generation being flushed, and when the flush was sent.
    flushing: Option<(u64, u64)>,
    /// Generation the boot's last verify read (for `next`).
    last_read: Option<u64>,
    failed: bool,
}

impl PmemRunner {
    pub fn new(cfg: &Config) -> Self {
        Self {
            jobs: cfg.pmem_jobs,
            current: 0,
            flushing: None,
            last_read: None,
            failed: false,
        }
    }

    /// All jobs finished.
    pub fn done(&self) -> bool {
        self.job().is_none()
    }

    /// A verify found no whole generation.
    pub fn failed(&self) -> bool {
        self.failed
    }

    fn job(&self) -> Option<PmemJob> {
        self.jobs.get(self.current).copied().flatten()
    }

    /// Runs the current job, or waits for its flush without blocking.
    pub fn poll(&mut self, pmem: &mut Pmem, now_ms: u64) {
        if let Some((generation, sent_ms)) = self.flushing {
            let Some(ret) = pmem.poll() else { return };
            if ret != 0 {
                say!("pmem: flush FAILED ret={} generation={}", ret, generation);
                exit(ExitCode::DeviceError);
            }
            say!(
                "pmem: flushed generation={} ms={}",
                generation,
                now_ms.saturating_sub(sent_ms)
            );
            self.flushing = None;
            self.current += 1;
            return;
        }
        match self.job() {
            None => {}
            Some(PmemJob::Verify) => {
                self.verify(pmem);
                self.current += 1;
            }
            Some(PmemJob::Write { next }) => {
                let generation = match (next, self.last_read) {
                    (true, Some(g)) => g.wrapping_add(1),
                    _ => 1,
                };
                let started = crate::time::now_ms();
                pmemfmt::fill(pmem.window(), generation);
                say!(
                    "pmem: wrote generation {} size={} ms={}",
                    generation,
                    pmem.size(),
                    crate::time::now_ms().saturating_sub(started)
                );
                if !pmem.flush() {
                    say!("pmem: error: the request queue is full");
                    exit(ExitCode::DeviceError);
                }
                self.flushing = Some((generation, crate::time::now_ms()));
            }
        }
    }

    fn verify(&mut self, pmem: &mut Pmem) {
        let started = crate::time::now_ms();
        let size = pmem.size();
        let state = pmemfmt::check(pmem.window());
        let ms = crate::time::now_ms().saturating_sub(started);
        match state {
            PmemState::Valid { generation } => {
                say!(
                    "pmem: read generation {} ok size={} ms={}",
                    generation,
                    size,
                    ms
                );
                self.last_read = Some(generation);
                return;
            }
            PmemState::Empty => say!("pmem: verify FAILED empty size={}", size),
            PmemState::BadHeader { magic, size: said } => say!(
                "pmem: verify FAILED bad header magic={:#x} size={} (window size={})",
                magic,
                said,
                size
            ),
            PmemState::Damaged {
                generation,
                first_bad,
                bad_words,
            } => say!(
                "pmem: verify FAILED generation={} bad_words={} first_bad_offset={:#x}",
                generation,
                bad_words,
                first_bad
            ),
        }
        self.failed = true;
    }
}
