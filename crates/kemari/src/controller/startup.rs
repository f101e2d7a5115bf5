//! Where the VM comes from: a fresh boot, a snapshot or warm-restart
//! directory, a prepared warm restart, an incoming live or zero-copy
//! migration, or a fault-tolerance primary this VMM stands by for.

use std::sync::Arc;

use vmm::config::MachineConfig;
use vmm::machine::Machine;
use vmm::output::{FenceSlot, FencedGate, OutputFence, OutputGate, PassThroughGate};
use vmm::persist::snapshot;
use vmm::vstate::VmEventSink;

use ft::standby::{StandbyOptions, StandbyOutcome};
use ft::status::FtShared;
use transfer::modes::{live, local, warm};

use crate::cli::{Args, CliError};

use super::ProcessError;

/// What this VMM waits for before it has a VM (for `GET /vm` meanwhile).
pub fn describe(args: &Args) -> &'static str {
    if args.ft_standby.is_some() {
        "a fault-tolerance standby"
    } else if args.incoming.is_some() {
        "waiting for an incoming live migration"
    } else if args.incoming_local.is_some() {
        "waiting for an incoming zero-copy migration"
    } else if args.restore.is_some() && args.await_state {
        "a warm-restart successor waiting for its VM"
    } else if args.restore.is_some() {
        "restoring its VM"
    } else {
        "booting its VM"
    }
}

/// How the VM came to run here (the `started` event's `how`).
pub fn how(args: &Args) -> &'static str {
    if args.ft_standby.is_some() {
        "failover"
    } else if args.incoming.is_some() {
        "live_migration"
    } else if args.incoming_local.is_some() {
        "zero_copy_migration"
    } else if args.restore.is_some() && args.await_state {
        "warm_restart"
    } else if args.restore.is_some() {
        "restore"
    } else {
        "boot"
    }
}

/// Builds the machine `args` describe (everything but a standby's); its
/// outputs wait for `fence` (an etcd lease) from the start.
pub fn make_machine(
    args: &Args,
    sink: VmEventSink,
    fence: Option<Arc<dyn OutputFence>>,
) -> Result<Machine, ProcessError> {
    let machine = build(args, sink, fence.clone())?;
    if let Some(f) = fence {
        machine.fence_outputs(f);
    }
    Ok(machine)
}

fn build(
    args: &Args,
    sink: VmEventSink,
    fence: Option<Arc<dyn OutputFence>>,
) -> Result<Machine, ProcessError> {
    let gate: Arc<dyn OutputGate> = match fence {
        Some(f) => FencedGate::wrap(Arc::new(FenceSlot::with(f)), Arc::new(PassThroughGate)),
        None => Arc::new(PassThroughGate),
    };
    let mut overrides = Ok(());
    let mut adjust = |config: &mut MachineConfig| {
        overrides = args.apply_restore_overrides(config);
    };
    if let (Some(dir), true) = (&args.restore, args.await_state) {
        let successor = warm::prepare(dir)?;
        let machine = successor.await_state(sink, args.start_paused, &mut adjust)?;
        overrides?;
        return Ok(machine);
    }
    if let Some(dir) = &args.restore {
        let mut state = snapshot::read_state(dir)?;
        args.apply_restore_overrides(&mut state.config)?;
        let memory = snapshot::load_memory(dir, &state, &args.memory_backing())?;
        state.config.memory_backing = memory.backing().clone();
        tracing::info!(dir = %dir.display(), "restoring VM");
        return Ok(Machine::restore(
            &state,
            memory,
            sink,
            args.start_paused,
            gate,
        )?);
    }
    if let Some(listen) = &args.incoming {
        let key_file = args
            .migration_key_file
            .as_ref()
            .ok_or(CliError::Missing("--migration-key-file (with --incoming)"))?;
        let key = transfer::key::read_key(key_file)?;
        let auth = transfer::channel::Auth::psk(&key, args.plaintext_link);
        let machine = live::migrate_in(listen, auth, sink, &mut adjust)?;
        overrides?;
        return Ok(machine);
    }
    if let Some(socket) = &args.incoming_local {
        let machine = local::migrate_in(socket, args.memory_file.as_deref(), sink, &mut adjust)?;
        overrides?;
        return Ok(machine);
    }
    let (config, _) = args.machine_config()?;
    Ok(Machine::build_with_gate(
        config,
        sink,
        args.start_paused,
        gate,
    )?)
}

/// Follows a primary as its fault-tolerance standby (`fence`: what it must
/// take before it fails over; `fence_cmd`: the helper that runs
/// `--ft-fence-cmd`).
pub fn standby(
    args: &Args,
    listen: &str,
    sink: VmEventSink,
    shared: &Arc<FtShared>,
    fence: Option<ft::fence::Arbiter>,
    fence_cmd: Option<ft::fence::FenceCommand>,
) -> Result<StandbyOutcome, ProcessError> {
    let key_file = args.migration_key_file.as_ref().ok_or(CliError::Missing(
        "--migration-key-file (with --ft-standby)",
    ))?;
    let opts = StandbyOptions {
        listen: listen.to_owned(),
        key: transfer::key::read_key(key_file)?,
        fence,
        fence_cmd,
        plaintext: args.plaintext_link,
    };
    hold_standby_start();
    let mut overrides = Ok(());
    let outcome = ft::standby::run(
        &opts,
        sink,
        &mut |config| overrides = args.apply_restore_overrides(config),
        shared,
    )?;
    overrides?;
    Ok(outcome)
}

/// Test builds only (feature `fault-injection`): a standby whose API
/// already answers holds before it listens for its primary for as long as
/// `KEMARI_FAULT_HOLD_STANDBY_START_MS` says, as a standby starting on a
/// slow host does (its `GET /vm/ft` says role `none`, `unprotected`
/// meanwhile).
#[cfg(feature = "fault-injection")]
fn hold_standby_start() {
    const VAR: &str = "KEMARI_FAULT_HOLD_STANDBY_START_MS";
    if let Some(ms) = std::env::var(VAR).ok().and_then(|v| v.parse::<u64>().ok()) {
        tracing::warn!(ms, "fault injection: holding the standby's start");
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Without the feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
fn hold_standby_start() {}
