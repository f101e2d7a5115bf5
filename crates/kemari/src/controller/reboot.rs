//! In-place guest reboot: a guest reset (or a triple fault, with
//! `--on-crash restart`) boots the guest again in this process, with the
//! same disks, TAPs, console, API socket, pid and identity
//! ([`Machine::reboot`] says what is kept and what is new).
//!
//! - The machine is here: it reboots at once; the `reset` (or `crashed`)
//!   event comes before, `rebooted` after.
//! - A long operation has it (a migration, a warm restart, a snapshot, an
//!   FT start): the operation is cancelled and the reboot made when the
//!   machine comes back. If the operation had already handed the VM over,
//!   the reboot request goes with it unheard (the guest runs on from after
//!   its reset instruction; Linux then tries its next reboot method).
//! - Fault tolerance ends at a reboot: the standby is told to stop (not to
//!   fail over) and the rebooted guest runs unprotected until `kemarictl ft
//!   start` again. Dirty tracking ends with the old VM.
//!
//! Each machine's guest events carry its generation; an event of the old
//! machine read after the reboot (a second vCPU's reset, an ACPI reset
//! followed by the i8042) is ignored.

use std::process::ExitCode;
use std::sync::mpsc::Sender;
use std::sync::Mutex;

use serde_json::json;
use vmm::machine::Machine;
use vmm::vstate::VmEventSink;

use super::shared::Role;
use super::{ft_events, Control, Controller, ProcessError, Slot};

/// Why the guest reboots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// It asked to (a reset).
    Reset,
    /// It crashed (a triple fault) and `--on-crash restart` was given.
    Crash,
}

impl Cause {
    fn as_str(self) -> &'static str {
        match self {
            Cause::Reset => "reset",
            Cause::Crash => "crash",
        }
    }
}

/// A sink sending the guest events of the machine of `generation` to the
/// main loop.
pub(super) fn vm_sink(tx: &Sender<Control>, generation: u64) -> VmEventSink {
    let tx = Mutex::new(tx.clone());
    VmEventSink::new(move |e| {
        let _ = tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Control::Vm(generation, e));
    })
}

impl Controller {
    /// Reboots the guest now, or once the running operation returns the
    /// machine (it is cancelled). The caller has stopped fault tolerance.
    pub(super) fn reboot(&mut self, cause: Cause) -> Option<Result<ExitCode, ProcessError>> {
        // Stopped by the caller: the rebooted guest runs unprotected.
        if self.ft_gate.take().is_some() {
            ft_events::observe(&self.shared);
        }
        match std::mem::replace(&mut self.slot, Slot::Away(0)) {
            Slot::Here(machine) => self.reboot_now(machine, cause),
            Slot::Away(id) => {
                self.slot = Slot::Away(id);
                if let Err(e) = self.shared.operations.cancel(None) {
                    tracing::info!(error = %e, "rebooting once the running operation returns the VM");
                }
                self.reboot_pending.get_or_insert(cause);
                None
            }
        }
    }

    fn reboot_now(
        &mut self,
        machine: Machine,
        cause: Cause,
    ) -> Option<Result<ExitCode, ProcessError>> {
        self.generation += 1;
        // Counted first: whoever sees the new boot (its console, its
        // network) sees the count.
        let reboots = self.shared.count_reboot();
        match machine.reboot(vm_sink(&self.tx, self.generation)) {
            Ok(machine) => {
                machine.start_console_flusher();
                self.shared.set_machine(machine.monitor());
                tracing::info!(reboots, cause = cause.as_str(), "guest rebooted in place");
                self.shared.events.publish(
                    "rebooted",
                    json!({ "cause": cause.as_str(), "reboots": reboots, "state": machine.state() }),
                );
                self.slot = Slot::Here(machine);
                None
            }
            Err(e) => {
                self.shared.set_role(Role::Ending);
                self.shared.events.publish(
                    "crashed",
                    json!({ "reason": "reboot failed", "message": e.to_string() }),
                );
                Some(Err(ProcessError::Reboot(e)))
            }
        }
    }
}
