//! The source's side of every hand-over: offer the VM, wait until the
//! other end is ready, (the mode's pre-copy,) pause and save, deliver what
//! is left and the state, pass the commit point, and wait for `Running`.
//!
//! Until the commit point the source owns the VM: any error leaves it
//! paused for the caller to resume (nothing was lost: the guest merely
//! waited). After it — `Commit` sent, or for a warm restart `StateSaved`
//! — the source never runs the VM again, whatever happens next;
//! [`Cancel::is_committed`] tells the caller which side of it an error
//! came from.

use std::path::Path;
use std::time::{Duration, Instant};

use vmm::machine::Machine;
use vmm::persist::{format, snapshot};

use crate::cancel::Cancel;
use crate::channel::{Channel, FdRead, FdWrite};
use crate::error::TransferError;
use crate::message::{Kind, Message, Mode};
use crate::precopy::PageSender;
use crate::progress::ProgressCell;

/// How long a source waits for the destination's `Running` after the
/// commit point (only logged if it does not come: nothing can undo it).
pub const RUNNING_TIMEOUT: Duration = Duration::from_secs(5);

/// A stream whose reads can time out.
pub trait ReadTimeout {
    /// Sets the read timeout.
    fn set_read_timeout_to(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl ReadTimeout for std::net::TcpStream {
    fn set_read_timeout_to(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(t)
    }
}

impl ReadTimeout for std::os::unix::net::UnixStream {
    fn set_read_timeout_to(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(t)
    }
}

/// Offers `machine` for `mode` (with `fds` on the offer, over a Unix
/// socket) and waits until the other end is ready for it.
pub fn offer<S: FdRead + FdWrite>(
    ch: &mut Channel<S>,
    mode: Mode,
    machine: &Machine,
    fds: &[std::os::fd::RawFd],
    progress: &ProgressCell,
) -> Result<(), TransferError> {
    offer_streams(ch, mode, machine, fds, 1, progress).map(|_| ())
}

/// [`offer`] over `streams` connections (a live migration): with more than
/// one, the destination must acknowledge them with `StreamsReady`; its
/// session number comes back (None for one stream). A destination that
/// answers a plain `Ready` ignored the field (an older kemari) and is
/// refused.
pub fn offer_streams<S: FdRead + FdWrite>(
    ch: &mut Channel<S>,
    mode: Mode,
    machine: &Machine,
    fds: &[std::os::fd::RawFd],
    streams: u32,
    progress: &ProgressCell,
) -> Result<Option<u64>, TransferError> {
    progress.phase("offering the VM");
    ch.set_phase("offering the VM");
    ch.send_msg_with_fds(
        &Message::Offer {
            mode,
            config: Box::new(machine.config().clone()),
            memory_size: machine.memory_file().size(),
            fds: fds.len() as u32,
            streams,
        },
        fds,
    )?;
    ch.flush()?;
    // While the other end gets ready (not in the pause, and not before the
    // offer: ~1 ms here, since each vCPU must leave the guest to read it).
    machine.prepare_to_save();
    ch.set_phase("waiting for it to be ready");
    progress.phase(&format!("waiting for the {} to be ready", ch.peer()));
    if streams <= 1 {
        ch.expect(&mut Vec::new(), "Ready", |m| matches!(m, Message::Ready))?;
        return Ok(None);
    }
    let answer = ch.expect(&mut Vec::new(), "StreamsReady", |m| {
        matches!(m, Message::StreamsReady { .. } | Message::Ready)
    })?;
    match answer {
        Message::StreamsReady { streams: n, session } if n == streams => Ok(Some(session)),
        Message::StreamsReady { streams: n, .. } => Err(TransferError::Mismatch(format!(
            "the {} accepts {n} connections where {streams} were offered",
            ch.peer()
        ))),
        _ => Err(TransferError::Mismatch(format!(
            "the {} does not take several connections (--connections {streams}): it runs an older kemari; run the same kemari release on both ends, or migrate with --connections 1",
            ch.peer()
        ))),
    }
}

/// What is left of a pre-copy for the pause: the sender (with its frame)
/// and the pages dirty at its last harvest.
pub struct LastPages<'a, 'm> {
    /// The pre-copy's sender.
    pub sender: &'a mut PageSender<'m>,
    /// Pages found dirty at the last harvest.
    pub carry: Vec<u64>,
    /// The last pre-copy round.
    pub round: u32,
}

/// Where the state goes.
#[derive(Debug, Clone, Copy)]
pub enum Delivery<'a> {
    /// In a frame, after the last pages (live, local); then `Restored`,
    /// `Commit`.
    Inline,
    /// Into the state directory, then `StateSaved` with the TAP fds
    /// (warm restart: the file survives whatever happens to the
    /// successor).
    StateDir(&'a Path),
}

/// Figures of a hand-over, as the source saw them.
#[derive(Debug, Clone, Copy)]
pub struct HandedOver {
    /// When the guest was paused.
    pub paused_at: Instant,
    /// Pause to the commit point (the guest's downtime as the source
    /// measures it).
    pub downtime: Duration,
    /// Pause to the destination's `Running` (None if it did not confirm).
    pub running: Option<Duration>,
    /// The destination's restore time, ms.
    pub restore_ms: f64,
    /// Bytes of the encoded state.
    pub state_bytes: usize,
    /// Pages sent with the guest paused.
    pub final_pages: u64,
}

/// Pauses and saves `machine`, delivers the last pages (`last`) and the
/// state, passes the commit point and waits for `Running`. On an error
/// before the commit point the machine is left paused for the caller to
/// resume; `cancel` refuses a late cancel from the commit point on.
pub fn pause_and_hand_over<S: FdRead + FdWrite + ReadTimeout>(
    ch: &mut Channel<S>,
    machine: &mut Machine,
    last: Option<LastPages<'_, '_>>,
    delivery: Delivery<'_>,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<HandedOver, TransferError> {
    let mut buf = Vec::new();
    // The first encode of a process is cold (see format::warm_up): not in
    // the pause.
    format::warm_up();
    cancel.check("pausing the VM")?;
    progress.phase("paused: sending the state");
    ch.set_phase("sending the last pages and the state");
    let paused_at = Instant::now();
    // Paused and saved in one go (one wake-up per vCPU); nothing runs
    // while the last pages are collected and sent, so the state stays
    // consistent.
    let state = machine.pause_and_save()?;
    let t_paused = paused_at.elapsed();
    let mut final_pages = 0;
    let state_bytes;
    let mut t_state_sent = Duration::ZERO;
    match delivery {
        Delivery::Inline => {
            let encoded = format::encode(&state)
                .map_err(|e| TransferError::Memory(format!("encoding the state: {e}")))?;
            state_bytes = encoded.len();
            match last {
                Some(LastPages {
                    sender,
                    mut carry,
                    round,
                }) => {
                    let round = round + 1;
                    let mut dirty = machine.harvest_dirty()?;
                    dirty.append(&mut carry);
                    dirty.sort_unstable();
                    dirty.dedup();
                    final_pages = dirty.len() as u64;
                    for pfn in dirty {
                        sender.page(ch, round, pfn, false)?;
                    }
                    // The last pages and the state with one write: the
                    // destination reads them at one wake-up.
                    match sender.take_payload(round) {
                        Some(pages) => {
                            ch.send_frames(&[(Kind::Pages, pages), (Kind::State, &encoded)])?
                        }
                        None => ch.send(Kind::State, &encoded)?,
                    }
                    sender.clear();
                    let memory = machine.memory_file();
                    crate::memory_digest::log_if_enabled("source", memory.file(), memory.size());
                }
                None => ch.send(Kind::State, &encoded)?,
            }
            ch.flush()?;
            t_state_sent = paused_at.elapsed();
            ch.set_phase("waiting for it to restore the VM");
            let restored = ch.expect(&mut buf, "Restored", |m| {
                matches!(m, Message::Restored { .. })
            })?;
            // Point of no return.
            cancel.commit("committing")?;
            progress.phase("committing");
            ch.set_phase("committing");
            ch.send_msg(&Message::Commit)?;
            ch.flush()?;
            if let Message::Restored { restore_ms } = restored {
                tracing::debug!(restore_ms, "the destination restored the VM");
            }
        }
        Delivery::StateDir(dir) => {
            let stats = snapshot::save_warm(dir, &state, machine.memory_file()).map_err(|e| {
                TransferError::File {
                    path: dir.display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                }
            })?;
            state_bytes = stats.state_bytes as usize;
            // From here on the VM never runs in this process again.
            let taps = machine.release_backends()?;
            cancel.commit("handing the VM over")?;
            progress.phase("committing");
            ch.set_phase("handing the VM over");
            let fds: Vec<_> = taps.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
            ch.send_msg_with_fds(
                &Message::StateSaved {
                    fds: fds.len() as u32,
                },
                &fds,
            )?;
            ch.flush()?;
            // The successor holds its own references now.
            drop(taps);
        }
    }
    let downtime = paused_at.elapsed();
    // Leave the CPU to the destination until its guest runs. Nothing from
    // here on can undo the hand-over: a missing confirmation is only
    // logged (but a warm successor's refusal is the caller's to report).
    let _ = ch.stream().set_read_timeout_to(Some(RUNNING_TIMEOUT));
    ch.set_phase("waiting for it to run the VM");
    let answer = ch.expect(&mut buf, "Running", |m| {
        matches!(m, Message::Running { .. })
    });
    let (running, restore_ms) = match answer {
        Ok(Message::Running { restore_ms }) => (Some(paused_at.elapsed()), restore_ms),
        Ok(_) => (None, 0.0),
        Err(e @ TransferError::Refused { .. }) if matches!(delivery, Delivery::StateDir(_)) => {
            return Err(e)
        }
        Err(e) => {
            tracing::warn!(error = %e, "the other end did not confirm it runs the VM");
            (None, 0.0)
        }
    };
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    tracing::debug!(
        paused_and_saved = ms(t_paused),
        state_sent = ms(t_state_sent),
        committed = ms(downtime),
        running = running.map(ms),
        final_pages,
        state_bytes,
        "hand-over: pause timeline (ms from the pause)"
    );
    Ok(HandedOver {
        paused_at,
        downtime,
        running,
        restore_ms,
        state_bytes,
        final_pages,
    })
}
