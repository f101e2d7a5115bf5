//! Pre-copy live migration over TCP (docs/migration-protocol.md): the
//! shared pre-copy with the downtime-estimate rule, then the pause, the
//! last pages with the state, and the commit. The destination runs the
//! guest as soon as it is restored, its outputs held until `Commit`.

use std::time::Duration;

use vmm::config::MachineConfig;
use vmm::machine::{Machine, RunState};
use vmm::vstate::VmEventSink;

use crate::cancel::Cancel;
use crate::channel::{Auth, Channel};
use crate::destination::{self, RunAs, Target};
use crate::error::{Peer, TransferError};
use crate::message::Mode;
use crate::net::{self, MIGRATION_SOCKET_BUFFER};
use crate::precopy::{self, DowntimeEstimate, PageSender};
use crate::progress::{Progress, ProgressCell};
use crate::source::{self, Delivery, LastPages};
use crate::streams::receive::Joiner;
use crate::streams::send::{MultiLink, PageStreams};
use crate::throttle::Throttle;

/// How long either end waits for the other at any step.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// How a migration uses the link.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    /// The cap of the rounds sent while the guest runs, if any.
    pub throttle: Option<Throttle>,
    /// TCP connections (1: the main one only; see `streams`).
    pub connections: u8,
}

/// Source side: live-migrates `machine` to the kemari listening at `to`
/// (`key`: [`Auth::psk`], encrypted unless a trusted link's opt-out),
/// over `link.connections` connections, the rounds before the pause capped
/// by `link.throttle` if given, reporting to
/// `progress`. On success the caller ends without resuming;
/// on failure or cancel the machine runs again (if it ran) and the error
/// says why.
pub fn migrate_out(
    machine: &mut Machine,
    to: &str,
    key: Auth<'_>,
    rule: DowntimeEstimate,
    link: LinkOptions,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<Progress, TransferError> {
    let was_running = machine.state() == RunState::Running;
    progress.start(to);
    let result = migrate_out_inner(machine, to, key, rule, link, cancel, progress);
    let result = cancel.explain(result, progress.snapshot().phase.as_str());
    match &result {
        Ok(()) => progress.finish("completed", None),
        Err(e) => {
            // The VM runs on here: its tracking ends (after a commit it
            // ends with the VM; stopping it is a memory-slot update, SRCU
            // grace period included).
            let _ = machine.stop_dirty_log();
            if was_running && machine.state() == RunState::Paused {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed migration");
                }
            }
            let status = if e.is_cancelled() {
                "cancelled"
            } else {
                "failed"
            };
            tracing::warn!(error = %e, "live migration {status}: the VM keeps running here");
            progress.finish(status, Some(e.to_string()));
        }
    }
    result.map(|()| progress.snapshot())
}

fn migrate_out_inner(
    machine: &mut Machine,
    to: &str,
    key: Auth<'_>,
    mut rule: DowntimeEstimate,
    LinkOptions {
        throttle,
        connections,
    }: LinkOptions,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<(), TransferError> {
    let stream = net::connect(
        to,
        Peer::Destination,
        Some(MIGRATION_SOCKET_BUFFER),
        Some(STEP_TIMEOUT),
    )?;
    cancel.watch_tcp(&stream);
    cancel.check("connecting")?;
    progress.phase("handshake");
    let mut ch = Channel::connect(stream, key, Peer::Destination)?;
    ch.note_timeout(Some(STEP_TIMEOUT));
    let streams = u32::from(connections.max(1));
    let session = source::offer_streams(&mut ch, Mode::Live, machine, &[], streams, progress)?;
    let mut page_streams = match session {
        Some(session) => {
            progress.phase("opening page streams");
            Some(PageStreams::open(
                to,
                key,
                streams - 1,
                session,
                STEP_TIMEOUT,
                cancel,
            )?)
        }
        None => None,
    };
    let memory = machine.guest_memory().clone();
    if let Some(t) = &throttle {
        tracing::info!(
            mib_s = t.bytes_per_s() as f64 / f64::from(1u32 << 20),
            "pre-copy rounds capped"
        );
    }
    let mut sender = PageSender::new(&memory).with_throttle(throttle);
    let pre = match page_streams.as_mut() {
        Some(streams) => {
            let mut link = MultiLink {
                main: &mut ch,
                streams,
            };
            precopy::run(machine, &mut link, &mut sender, &mut rule, cancel, progress)?
        }
        None => precopy::run(machine, &mut ch, &mut sender, &mut rule, cancel, progress)?,
    };
    // The streams' work is done (every round acknowledged): closed before
    // the pause, whose pages and state go on the main connection.
    let stream_bytes = match page_streams.take() {
        Some(streams) => {
            let bytes = streams.bytes;
            streams.finish()?;
            bytes
        }
        None => 0,
    };
    // The pages that go with the guest paused are not held back.
    sender = sender.with_throttle(None);
    let handed = source::pause_and_hand_over(
        &mut ch,
        machine,
        Some(LastPages {
            sender: &mut sender,
            carry: pre.carry,
            round: pre.rounds,
        }),
        Delivery::Inline,
        cancel,
        progress,
    )?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let total = progress.snapshot().elapsed_ms;
    progress.update(|p| {
        p.round = pre.rounds + 1;
        p.bytes_sent = ch.bytes_sent + stream_bytes;
        p.pages_sent = sender.pages;
        p.remaining_pages = 0;
        p.downtime_ms = Some(ms(handed.downtime));
        p.running_ms = handed.running.map(ms);
        p.total_ms = Some(total as f64);
        p.stop_reason = Some(pre.stop_reason.into());
    });
    tracing::info!(
        rounds = pre.rounds + 1,
        final_pages = handed.final_pages,
        restore_ms = handed.restore_ms,
        downtime_ms = ms(handed.downtime),
        "live migration committed"
    );
    Ok(())
}

/// Destination side: listens on `listen`, takes one VM over and returns it
/// running. `adjust` may change the saved configuration (this host's TAP
/// names, serial output). On any failure nothing of the VM runs here.
pub fn migrate_in(
    listen: &str,
    key: Auth<'_>,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
) -> Result<Machine, TransferError> {
    let listener = net::listen(listen)?;
    let tuning = net::Tuning {
        receive_buffer: Some(MIGRATION_SOCKET_BUFFER),
        read_timeout: Some(STEP_TIMEOUT),
    };
    let (mut ch, _) = net::accept_authenticated(
        &listener,
        listen,
        Peer::Source,
        key,
        tuning,
        net::HANDSHAKE_TIMEOUT,
    )?;
    ch.note_timeout(Some(STEP_TIMEOUT));
    // Open for the page streams of an offer of several connections only.
    let joiner = Joiner::new(listener, key, STEP_TIMEOUT);
    let machine = destination::receive_joined(
        &mut ch,
        Mode::Live.name(),
        &mut Target::FreshMemory,
        RunAs::RunHeld,
        events,
        adjust,
        Some(joiner),
    )?;
    machine.announce_network();
    tracing::info!("live migration: VM taken over and running");
    Ok(machine)
}
