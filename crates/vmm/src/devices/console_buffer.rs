//! Line buffering between the UART and the console's destination.
//!
//! The UART model (vm-superio) writes and flushes every byte the guest
//! sends, and a guest sends one byte per exit (on this PVM host even a
//! `rep outsb` arrives byte by byte): one `write(2)` per byte, each waking
//! whoever reads the console — measured, 80 system calls and 80 wake-ups
//! for an 80-character line, every line. [`ConsoleBuffer`] collects bytes
//! and writes whole lines: at a newline, when [`MAX_PENDING`] bytes are
//! waiting, when the machine pauses ([`ConsoleBuffer::flush_pending`]) and
//! when it is dropped. A partial line (a shell prompt) goes out at most
//! [`PARTIAL_DELAY`] after its first byte, written by a small thread that
//! starts on the first partial line (or earlier:
//! [`ConsoleBuffer::start_flusher_now`]).
//!
//! The console is an output of the VM like a packet sent: while the
//! machine's [`OutputGate`] holds outputs
//! ([`OutputGate::console_may_write`] false: a live migration's destination
//! before the source's commit) bytes wait here, up to [`MAX_HELD`], and go
//! out once it lets them; a buffer dropped while held writes nothing.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::serial_output::SerialOutput;
use crate::output::OutputGate;

/// How long a partial line may wait for its newline.
pub const PARTIAL_DELAY: Duration = Duration::from_millis(2);
/// Bytes written at once even without a newline.
pub const MAX_PENDING: usize = 4096;
/// Bytes kept while the gate holds the console; older ones are dropped.
pub const MAX_HELD: usize = 1 << 20;

struct Pending {
    out: SerialOutput,
    gate: Arc<dyn OutputGate>,
    /// Bytes dropped while held, beyond [`MAX_HELD`].
    dropped_held: u64,
    buf: Vec<u8>,
    /// When the oldest byte of `buf` arrived, if `buf` holds any.
    since: Option<Instant>,
    /// The flusher thread runs.
    flusher: bool,
    /// The flusher waits without a deadline: a new partial line must wake
    /// it. While output flows it polls instead, so that the vCPU writing
    /// the console wakes nobody.
    flusher_asleep: bool,
    /// The flusher thread is to end.
    closed: bool,
}

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A line-buffering [`Write`] in front of a [`SerialOutput`] (see the module
/// documentation). `flush` is a no-op: the UART calls it after every byte.
pub struct ConsoleBuffer {
    shared: Arc<Shared>,
}

impl ConsoleBuffer {
    /// Buffers the bytes bound for `out`; `gate` decides when they may go
    /// (see the module documentation).
    pub fn new(out: SerialOutput, gate: Arc<dyn OutputGate>) -> Self {
        ConsoleBuffer {
            shared: Arc::new(Shared {
                pending: Mutex::new(Pending {
                    out,
                    gate,
                    dropped_held: 0,
                    buf: Vec::new(),
                    since: None,
                    flusher: false,
                    flusher_asleep: false,
                    closed: false,
                }),
                wake: Condvar::new(),
            }),
        }
    }

    /// Starts the flusher thread now rather than at the first partial line,
    /// which comes from a vCPU thread: right after a live migration's
    /// restore that thread start (~0.05 ms here) was inside the guest's
    /// first console write. The caller is a thread the guest does not wait
    /// for. Does nothing if it runs, or for a console that goes nowhere.
    pub fn start_flusher_now(&self) {
        let mut p = self.shared.lock();
        if !p.flusher && !matches!(p.out, SerialOutput::Null) {
            self.start_flusher(&mut p);
        }
    }

    /// Writes every byte still waiting.
    pub fn flush_pending(&self) {
        write_out(&mut self.shared.lock(), usize::MAX);
    }

    /// Writes what waits and hands the output over (a reboot keeps the
    /// console's file or socket): this buffer writes nowhere afterwards.
    pub fn take_output(&self) -> SerialOutput {
        let mut p = self.shared.lock();
        write_out(&mut p, usize::MAX);
        std::mem::replace(&mut p.out, SerialOutput::Null)
    }

    /// Bytes waiting (for tests and metrics).
    pub fn pending_len(&self) -> usize {
        self.shared.lock().buf.len()
    }

    fn start_flusher(&self, p: &mut Pending) {
        if !crate::seccomp::this_thread_may_spawn() {
            // A vCPU thread under its seccomp filter: the line goes out now,
            // and the flusher waits for a thread that may start it.
            write_out(p, usize::MAX);
            return;
        }
        let shared = self.shared.clone();
        let started = std::thread::Builder::new()
            .name("console".into())
            .spawn(move || flush_partial_lines(&shared));
        match started {
            Ok(_) => p.flusher = true,
            Err(e) => {
                // Without the thread, partial lines go out at once.
                tracing::debug!(error = %e, "cannot start the console flusher");
                write_out(p, usize::MAX);
            }
        }
    }
}

/// Writes the first `upto` bytes of the buffer (all of them at most), if
/// the gate lets the console write.
fn write_out(p: &mut Pending, upto: usize) {
    let n = upto.min(p.buf.len());
    if n == 0 || !p.gate.console_may_write() {
        return;
    }
    let Pending { out, buf, .. } = p;
    if let Err(e) = out.write_all(&buf[..n]).and_then(|_| out.flush()) {
        tracing::debug!(error = %e, "console write failed");
    }
    buf.drain(..n);
    p.since = if p.buf.is_empty() {
        None
    } else {
        Some(Instant::now())
    };
}

/// Idle polls of the flusher before it sleeps until woken.
const LINGER_POLLS: u32 = 50;

/// The flusher thread: writes a partial line once it has waited
/// [`PARTIAL_DELAY`]; polls every [`PARTIAL_DELAY`] while output flows and
/// sleeps [`LINGER_POLLS`] polls after it stopped; ends when the buffer is
/// dropped.
fn flush_partial_lines(shared: &Shared) {
    let mut p = shared.lock();
    let mut idle_polls = 0;
    loop {
        if p.closed {
            return;
        }
        let now = Instant::now();
        let wait = match p.since {
            Some(since) if now >= since + PARTIAL_DELAY => {
                write_out(&mut p, usize::MAX);
                idle_polls = 0;
                if p.buf.is_empty() {
                    continue;
                }
                // Held by the gate: look again a delay later (not at once,
                // which would spin holding the lock a vCPU needs).
                Some(PARTIAL_DELAY)
            }
            Some(since) => {
                idle_polls = 0;
                Some(since + PARTIAL_DELAY - now)
            }
            None if idle_polls < LINGER_POLLS => {
                idle_polls += 1;
                Some(PARTIAL_DELAY)
            }
            None => None,
        };
        p = match wait {
            Some(d) => {
                shared
                    .wake
                    .wait_timeout(p, d)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => {
                p.flusher_asleep = true;
                let mut p = shared.wake.wait(p).unwrap_or_else(|e| e.into_inner());
                p.flusher_asleep = false;
                idle_polls = 0;
                p
            }
        };
    }
}

impl Write for ConsoleBuffer {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut p = self.shared.lock();
        if matches!(p.out, SerialOutput::Null) {
            return Ok(data.len());
        }
        let was_empty = p.buf.is_empty();
        p.buf.extend_from_slice(data);
        if p.buf.len() > MAX_HELD && !p.gate.console_may_write() {
            let cut = p.buf.len() - MAX_HELD;
            p.buf.drain(..cut);
            if p.dropped_held == 0 {
                tracing::warn!(
                    "console output held beyond {MAX_HELD} bytes: the oldest is dropped"
                );
            }
            p.dropped_held += cut as u64;
        }
        if p.buf.len() >= MAX_PENDING {
            write_out(&mut p, usize::MAX);
        } else if let Some(last) = data.iter().rposition(|&b| b == b'\n') {
            let upto = p.buf.len() - (data.len() - 1 - last);
            write_out(&mut p, upto);
        }
        if !p.buf.is_empty() && was_empty {
            p.since.get_or_insert_with(Instant::now);
            if !p.flusher {
                self.start_flusher(&mut p);
            } else if p.flusher_asleep {
                self.shared.wake.notify_one();
            }
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for ConsoleBuffer {
    fn drop(&mut self) {
        let mut p = self.shared.lock();
        write_out(&mut p, usize::MAX);
        p.closed = true;
        self.shared.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A console writing to an unlinked file, and a reader of that file.
    fn file_pair() -> (ConsoleBuffer, std::fs::File) {
        file_pair_gated(Arc::new(crate::output::PassThroughGate))
    }

    /// [`file_pair`] behind `gate`.
    fn file_pair_gated(gate: Arc<dyn OutputGate>) -> (ConsoleBuffer, std::fs::File) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "kemari-console-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let out = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .unwrap();
        let reader = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        (ConsoleBuffer::new(SerialOutput::File(out), gate), reader)
    }

    fn read_all(f: &mut std::fs::File) -> String {
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn whole_lines_go_out_at_the_newline() {
        let (mut c, mut r) = file_pair();
        for &b in b"counter: 1\ncounter: 2" {
            c.write_all(&[b]).unwrap();
            c.flush().unwrap();
        }
        assert_eq!(read_all(&mut r), "counter: 1\n");
        assert_eq!(c.pending_len(), "counter: 2".len());
        c.write_all(b"\n").unwrap();
        assert_eq!(read_all(&mut r), "counter: 2\n");
        assert_eq!(c.pending_len(), 0);
    }

    #[test]
    fn a_taken_output_gets_the_partial_line_and_the_next_buffer() {
        let (mut c, mut r) = file_pair();
        c.write_all(b"before reboot").unwrap();
        let out = c.take_output();
        assert_eq!(read_all(&mut r), "before reboot");
        // The old buffer writes nowhere; the next one to the same file.
        c.write_all(b"lost\n").unwrap();
        drop(c);
        let mut next = ConsoleBuffer::new(out, Arc::new(crate::output::PassThroughGate));
        next.write_all(b"after\n").unwrap();
        assert_eq!(read_all(&mut r), "after\n");
    }

    #[test]
    fn a_partial_line_goes_out_after_the_delay() {
        let (mut c, mut r) = file_pair();
        c.write_all(b"login: ").unwrap();
        let deadline = Instant::now() + PARTIAL_DELAY * 50;
        let mut seen = String::new();
        while seen.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            seen = read_all(&mut r);
        }
        assert_eq!(seen, "login: ");
        assert_eq!(c.pending_len(), 0);
        // And again, once the flusher waits for the next one.
        c.write_all(b"x").unwrap();
        let deadline = Instant::now() + PARTIAL_DELAY * 50;
        let mut seen = String::new();
        while seen.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            seen = read_all(&mut r);
        }
        assert_eq!(seen, "x");
    }

    #[test]
    fn a_pause_and_a_drop_lose_nothing() {
        let (mut c, mut r) = file_pair();
        c.write_all(b"half a li").unwrap();
        c.flush_pending();
        assert_eq!(read_all(&mut r), "half a li");
        c.write_all(b"ne, then exit").unwrap();
        drop(c);
        assert_eq!(read_all(&mut r), "ne, then exit");
    }

    #[test]
    fn a_long_run_without_newline_is_written_in_blocks() {
        let (mut c, mut r) = file_pair();
        c.write_all(&vec![b'.'; MAX_PENDING + 10]).unwrap();
        assert_eq!(read_all(&mut r).len(), MAX_PENDING + 10);
        assert_eq!(c.pending_len(), 0);
    }

    #[test]
    fn held_bytes_go_out_after_the_commit_and_never_after_a_discard() {
        use crate::output::CommitGate;
        let gate = Arc::new(CommitGate::default());
        let (mut c, mut r) = file_pair_gated(gate.clone());
        c.write_all(b"counter: 1\npartial").unwrap();
        c.flush_pending();
        assert_eq!(read_all(&mut r), "", "a held console wrote");
        gate.commit();
        c.write_all(b" line\n").unwrap();
        assert_eq!(read_all(&mut r), "counter: 1\npartial line\n");

        let gate = Arc::new(CommitGate::default());
        let (mut c, mut r) = file_pair_gated(gate.clone());
        c.write_all(b"counter: 1\n").unwrap();
        gate.discard();
        drop(c);
        assert_eq!(read_all(&mut r), "", "a discarded run's console wrote");
    }

    #[test]
    fn a_held_partial_line_does_not_block_the_writer() {
        use crate::output::CommitGate;
        let gate = Arc::new(CommitGate::default());
        let (mut c, mut r) = file_pair_gated(gate.clone());
        c.write_all(b"half").unwrap();
        // Past the partial-line delay the flusher finds it held; the guest
        // side must still get the lock, promptly, every time.
        std::thread::sleep(PARTIAL_DELAY * 3);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..100 {
                c.write_all(b"x").unwrap();
            }
            let _ = done_tx.send(c);
        });
        let mut c = done_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the writer waited on the flusher");
        assert_eq!(read_all(&mut r), "");
        gate.commit();
        c.write_all(b"\n").unwrap();
        assert_eq!(read_all(&mut r), format!("half{}\n", "x".repeat(100)));
    }
}
