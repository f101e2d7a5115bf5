//! The primary: connect to the standby and offer the VM (the transfer
//! layer's channel and offer), the initial synchronization (its pre-copy
//! loop with the [`FirstConvergence`] rule, while the guest runs), the first
//! epoch with the machine paused, then the [`FtGate`] in the device event
//! loop: one sync per batch of outputs or per period.
//!
//! Cancelling (`ft stop` during the initial synchronization) is possible
//! until the first epoch is sent: before it the standby holds no complete
//! image and cannot fail over, so the link is simply cut. From the first
//! epoch on, protection is `ft stop`'s to end (it tells the standby to
//! exit instead of failing over).

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use vmm::machine::{Machine, RunState};

use transfer::channel::{Auth, Channel};
use transfer::message::{Message, Mode};
use transfer::precopy::{self, FirstConvergence, PageSender};
use transfer::{net, source, Cancel, Peer, TransferError};

use crate::gate::FtGate;
use crate::link::Link;
use crate::status::{FtShared, FtState};
use crate::{FtError, SyncMode};

/// What `kemarictl ft start` asks for.
#[derive(Debug, Clone)]
pub struct FtStartOptions {
    /// The standby's `host:port`.
    pub peer: String,
    /// Pre-shared key.
    pub key: Vec<u8>,
    /// Event-driven or periodic.
    pub mode: SyncMode,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Peer lost after this long without a frame.
    pub timeout: Duration,
    /// Pages the guest rewrites from sync to sync left writable, at most.
    pub keep_writable: usize,
    /// Epochs unacknowledged at once, at most (event-driven mode).
    pub epochs_in_flight: usize,
    /// An authenticated but unencrypted link (a trusted, dedicated one).
    pub plaintext: bool,
}

/// Protects `machine` with the standby at `opts.peer`: live pre-copy while
/// the guest runs, then the first epoch with the machine paused, then the
/// gate. On failure or cancel nothing changes (the VM runs on unprotected)
/// and the error says why.
pub fn start(
    machine: &mut Machine,
    opts: &FtStartOptions,
    shared: &Arc<FtShared>,
    cancel: &Cancel,
) -> Result<Arc<FtGate>, FtError> {
    if matches!(shared.state(), FtState::Protected | FtState::Syncing) {
        return Err(FtError::State("the VM is already protected".into()));
    }
    if let Some(p) = machine.config().pmem.first() {
        // Its window is outside guest RAM: no sync would carry the guest's
        // writes to it, and the standby could not map it (docs/warm-cache.md).
        return Err(FtError::State(format!(
            "fault tolerance cannot protect a VM with a pmem device ({}): its writes to the pmem are not replicated",
            p.path.display()
        )));
    }
    let period = match opts.mode {
        SyncMode::Periodic(p) => Some(p),
        SyncMode::EventDriven => None,
    };
    shared.begin(
        "primary",
        FtState::Syncing,
        &opts.peer,
        opts.mode.name(),
        period,
    );
    if opts.mode == SyncMode::EventDriven {
        shared.set_epochs_in_flight(opts.epochs_in_flight);
    }
    shared.initial.start(&opts.peer);
    let started = Instant::now();
    let was_running = machine.state() == RunState::Running;
    let on_lost = Arc::new(OnceLock::new());
    let mut link = None;
    let result = connect_and_sync(machine, opts, shared, cancel, &on_lost, &mut link);
    let result = match result {
        Err(FtError::Transfer(e)) => Err(FtError::Transfer(
            cancel
                .explain(Err::<(), _>(e), "synchronizing the standby")
                .unwrap_err(),
        )),
        other => other,
    };
    match result {
        Ok(gate) => {
            shared.set_state(FtState::Protected);
            shared.initial.finish("completed", None);
            tracing::info!(
                peer = %opts.peer,
                mode = opts.mode.name(),
                initial_ms = started.elapsed().as_millis() as u64,
                "fault tolerance: protected"
            );
            Ok(gate)
        }
        Err(e) => {
            if let Some(link) = link {
                // The standby must exit, not fail over, whatever it has.
                let _ = link.send_msg(&Message::Stop {
                    reason: format!("the primary gave up protecting: {e}"),
                });
                link.close();
            }
            let _ = machine.stop_dirty_log();
            if was_running && machine.state() == RunState::Paused {
                // Paused by us for the first epoch.
                let _ = machine.resume();
            }
            let cancelled = matches!(&e, FtError::Transfer(t) if t.is_cancelled());
            shared.set_error(e.to_string());
            shared.set_state(FtState::Unprotected);
            shared.initial.finish(
                if cancelled { "cancelled" } else { "failed" },
                Some(e.to_string()),
            );
            tracing::warn!(error = %e, "fault tolerance could not start; the VM runs on unprotected");
            Err(e)
        }
    }
}

fn connect_and_sync(
    machine: &mut Machine,
    opts: &FtStartOptions,
    shared: &Arc<FtShared>,
    cancel: &Cancel,
    on_lost: &Arc<OnceLock<Weak<FtGate>>>,
    link_out: &mut Option<Arc<Link>>,
) -> Result<Arc<FtGate>, FtError> {
    let stream = net::connect(&opts.peer, Peer::Standby, None, Some(opts.timeout))?;
    cancel.watch_tcp(&stream);
    cancel.check("connecting to the standby")?;
    stream
        .set_write_timeout(Some(opts.timeout))
        .map_err(|e| TransferError::io(Peer::Standby, "connecting", None, e))?;
    let mut ch = Channel::connect(stream, Auth::psk(&opts.key, opts.plaintext), Peer::Standby)?;
    ch.note_timeout(Some(opts.timeout));
    let mode = Mode::FaultTolerance {
        sync: opts.mode.name().into(),
        heartbeat_ms: opts.heartbeat.as_millis() as u64,
        timeout_ms: opts.timeout.as_millis() as u64,
    };
    source::offer(&mut ch, mode, machine, &[], &shared.initial)?;
    let link = Link::start(ch, opts.heartbeat, opts.timeout, on_lost.clone())?;
    *link_out = Some(link.clone());
    initial_sync(machine, opts, shared, &link, on_lost, cancel)
}

fn initial_sync(
    machine: &mut Machine,
    opts: &FtStartOptions,
    shared: &Arc<FtShared>,
    link: &Arc<Link>,
    on_lost: &OnceLock<Weak<FtGate>>,
    cancel: &Cancel,
) -> Result<Arc<FtGate>, FtError> {
    let started = Instant::now();
    // A VM started paused can be protected before it runs at all.
    let was_running = machine.state() == RunState::Running;
    let memory = machine.guest_memory().clone();
    let mut sender = PageSender::new(&memory);
    let pre = precopy::run(
        machine,
        &mut &**link,
        &mut sender,
        &mut FirstConvergence::default(),
        cancel,
        &shared.initial,
    )?;
    // From the first epoch on the standby can run the VM: no more cancel.
    cancel.commit("sending the first epoch")?;
    shared.initial.phase("first epoch");
    // The first epoch: the whole machine at rest.
    if was_running {
        machine.pause()?;
    }
    let gate = Arc::new(FtGate::new(
        machine.core(),
        opts.mode,
        link.clone(),
        opts.keep_writable,
        env_flag(std::env::var_os("KEMARI_FT_HOLD_VCPUS")),
        opts.epochs_in_flight,
        shared.clone(),
    ));
    let _ = on_lost.set(Arc::downgrade(&gate));
    gate.sync_epoch(link, &[], pre.carry)?;
    machine.set_output_gate(gate.clone())?;
    if was_running {
        machine.resume()?;
    }
    shared.initial_sync_done(started.elapsed(), link.bytes());
    Ok(gate)
}

/// A switch in the environment: on when set to anything but nothing, `0`,
/// `false`, `no` or `off` (`KEMARI_FT_HOLD_VCPUS=0` once switched it *on*).
fn env_flag(value: Option<std::ffi::OsString>) -> bool {
    value.is_some_and(|v| {
        !matches!(
            v.to_string_lossy().trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no" | "off"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_environment_switch_is_off_unless_set_to_something_true() {
        let f = |v: Option<&str>| env_flag(v.map(std::ffi::OsString::from));
        assert!(!f(None));
        for off in ["", "0", "false", "No", " off "] {
            assert!(!f(Some(off)), "{off:?}");
        }
        for on in ["1", "yes", "true"] {
            assert!(f(Some(on)), "{on:?}");
        }
    }
}
