//! Saving and restoring one vCPU's KVM state. Both run on the vCPU's own thread
//! (through `VcpuHandle::with_fd`) or before that thread starts.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

/// What a vCPU made ahead holds; defined beside the vCPU, which reads it.
pub use crate::vstate::vcpu::InPlace;

/// MSRs that KVM lists but refuses some values of on restore (environment.md:
/// MSR_KVM_POLL_CONTROL rejects 0): skipped when they hold that value.
const MSR_KVM_POLL_CONTROL: u32 = 0x4b56_4d06;

/// Errors saving or restoring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    /// A KVM ioctl failed.
    #[error("vCPU {index}: KVM {what} failed")]
    Kvm {
        /// vCPU index.
        index: u8,
        /// The operation.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The saved state does not fit KVM's structures.
    #[error("vCPU {index}: saved {what} is invalid")]
    Invalid {
        /// vCPU index.
        index: u8,
        /// Which part.
        what: &'static str,
    },
}

/// Everything KVM holds for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// vCPU index (= APIC ID).
    pub index: u8,
    /// CPUID as the guest saw it.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// Pending exceptions, interrupts, NMIs.
    pub events: kvm_vcpu_events,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Run state (running, halted, waiting for SIPI).
    pub mp_state: kvm_mp_state,
    /// Model-specific registers (TSC, kvmclock, syscall MSRs...).
    pub msrs: Vec<kvm_msr_entry>,
    /// TSC frequency in kHz, when KVM knows it.
    pub tsc_khz: Option<u32>,
}

fn kvm(index: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuStateError {
    move |source| VcpuStateError::Kvm {
        index,
        what,
        source,
    }
}

/// The MSRs a vCPU's state holds: KVM's list (KVM_GET_MSR_INDEX_LIST) and
/// those kemari sets at boot that the list leaves out (the MTRR default
/// type, which KVM emulates but does not list).
pub fn msr_indices(kvm: &kvm_ioctls::Kvm) -> Result<Vec<u32>, kvm_ioctls::Error> {
    let mut list = kvm.get_msr_index_list()?.as_slice().to_vec();
    for (index, _) in crate::vstate::vcpu::BOOT_MSRS {
        if !list.contains(&index) {
            list.push(index);
        }
    }
    Ok(list)
}

/// Reads every MSR in `indices`; MSRs KVM refuses to read are left out.
fn read_msrs(
    fd: &VcpuFd,
    index: u8,
    indices: &[u32],
) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<_> = rest
            .iter()
            .map(|&i| kvm_msr_entry {
                index: i,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| VcpuStateError::Invalid {
            index,
            what: "MSR list",
        })?;
        let n = fd.get_msrs(&mut msrs).map_err(kvm(index, "KVM_GET_MSRS"))?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        // KVM stops at the first MSR it cannot read: skip that one.
        rest = &rest[(n + 1).min(rest.len())..];
    }
    Ok(out)
}

/// Saves vCPU `index`'s state. `msr_indices` comes from KVM_GET_MSR_INDEX_LIST.
pub fn save(fd: &VcpuFd, index: u8, msr_indices: &[u32]) -> Result<VcpuState, VcpuStateError> {
    save_with(fd, index, msr_indices, &read_constants(fd, index)?)
}

/// The parts of a vCPU's state that never change once it exists: KVM
/// refuses a different CPUID after the first KVM_RUN, and kemari sets the TSC
/// frequency only at creation or restore. Read once per vCPU (see
/// [`save_with`]), they spare every later save two ioctls (~6 µs each on
/// this PVM host), which a fault-tolerance sync pays on every output.
#[derive(Debug, Clone)]
pub struct VcpuConstants {
    cpuid: Vec<kvm_cpuid_entry2>,
    tsc_khz: Option<u32>,
}

/// Reads a vCPU's [`VcpuConstants`].
pub fn read_constants(fd: &VcpuFd, index: u8) -> Result<VcpuConstants, VcpuStateError> {
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm(index, "KVM_GET_CPUID2"))?;
    Ok(VcpuConstants {
        cpuid: cpuid.as_slice().to_vec(),
        tsc_khz: fd.get_tsc_khz().ok().filter(|&k| k > 0),
    })
}

/// [`save`] with the vCPU's constants read earlier by [`read_constants`].
pub fn save_with(
    fd: &VcpuFd,
    index: u8,
    msr_indices: &[u32],
    constants: &VcpuConstants,
) -> Result<VcpuState, VcpuStateError> {
    // KVM_GET_MP_STATE first: it processes a pending INIT, which resets the
    // registers.
    let mp_state = fd.get_mp_state().map_err(kvm(index, "KVM_GET_MP_STATE"))?;
    // On the vCPU's own thread right after an exit, KVM has already stored
    // the registers and special registers in `kvm_run`; trusted only for a
    // runnable vCPU (one that took an INIT since is not).
    let synced = (mp_state.mp_state == kvm_bindings::KVM_MP_STATE_RUNNABLE)
        .then(|| crate::vstate::vcpu::synced_registers(fd))
        .flatten();
    Ok(VcpuState {
        index,
        cpuid: constants.cpuid.clone(),
        mp_state,
        regs: match &synced {
            Some(s) => s.regs,
            None => fd.get_regs().map_err(kvm(index, "KVM_GET_REGS"))?,
        },
        sregs: match &synced {
            Some(s) => s.sregs,
            None => fd.get_sregs().map_err(kvm(index, "KVM_GET_SREGS"))?,
        },
        xsave: fd.get_xsave().map_err(kvm(index, "KVM_GET_XSAVE"))?,
        xcrs: fd.get_xcrs().map_err(kvm(index, "KVM_GET_XCRS"))?,
        debugregs: fd
            .get_debug_regs()
            .map_err(kvm(index, "KVM_GET_DEBUGREGS"))?,
        lapic: fd.get_lapic().map_err(kvm(index, "KVM_GET_LAPIC"))?,
        msrs: read_msrs(fd, index, msr_indices)?,
        // Always by ioctl: it folds in an NMI queued since the exit.
        events: fd
            .get_vcpu_events()
            .map_err(kvm(index, "KVM_GET_VCPU_EVENTS"))?,
        tsc_khz: constants.tsc_khz,
    })
}

/// The XCRs that matter in `a` and `b` are the same.
fn same_xcrs(a: &kvm_xcrs, b: &kvm_xcrs) -> bool {
    let n = a.nr_xcrs as usize;
    a.nr_xcrs == b.nr_xcrs
        && a.flags == b.flags
        && n <= a.xcrs.len()
        && a.xcrs[..n]
            .iter()
            .zip(&b.xcrs[..n])
            .all(|(x, y)| x.xcr == y.xcr && x.value == y.value)
}

/// The debug registers in `a` and `b` are the same.
fn same_debugregs(a: &kvm_debugregs, b: &kvm_debugregs) -> bool {
    a.db == b.db && a.dr6 == b.dr6 && a.dr7 == b.dr7 && a.flags == b.flags
}

/// Restores `state` into `fd` (a freshly created vCPU of the same index).
/// `in_place` is what the vCPU holds if it was made ahead: parts of the
/// state equal to it are not written again.
pub fn restore(
    fd: &VcpuFd,
    state: &VcpuState,
    in_place: Option<&InPlace>,
) -> Result<(), VcpuStateError> {
    let index = state.index;
    let set_cpuid = || -> Result<(), VcpuStateError> {
        let cpuid = CpuId::from_entries(&state.cpuid).map_err(|_| VcpuStateError::Invalid {
            index,
            what: "CPUID",
        })?;
        fd.set_cpuid2(&cpuid).map_err(kvm(index, "KVM_SET_CPUID2"))
    };
    let cpuid_in_place = in_place.and_then(|p| p.cpuid.as_deref());
    match cpuid_in_place.map(|set| crate::vstate::cpuid::difference(&state.cpuid, set)) {
        Some(None) => tracing::debug!(vcpu = index, "CPUID already in place"),
        Some(Some(why)) => {
            tracing::debug!(vcpu = index, %why, "the CPUID set ahead is not the saved one");
            set_cpuid()?;
        }
        None => set_cpuid()?,
    }
    if let Some(khz) = state.tsc_khz {
        let here = match in_place {
            Some(p) => p.tsc_khz,
            None => fd.get_tsc_khz().ok(),
        };
        if here != Some(khz) {
            // Without TSC scaling KVM accepts only a rate within 250 ppm of
            // this host's: elsewhere (the lab's virtual hosts calibrate their
            // TSCs a little differently at each boot) the guest goes on at
            // this host's rate, as QEMU does; its kvmclock follows (KVM
            // updates the pvclock parameters), a raw-TSC clock would drift.
            if let Err(e) = fd.set_tsc_khz(khz) {
                tracing::warn!(
                    vcpu = index,
                    saved_khz = khz,
                    host_khz = ?here,
                    error = %e,
                    "cannot give the vCPU its saved TSC rate (no TSC scaling here): it runs at this host's"
                );
            }
        }
    }
    if in_place.and_then(|p| p.mp_state).map(|m| m.mp_state) != Some(state.mp_state.mp_state) {
        fd.set_mp_state(state.mp_state)
            .map_err(kvm(index, "KVM_SET_MP_STATE"))?;
    }
    fd.set_regs(&state.regs)
        .map_err(kvm(index, "KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs)
        .map_err(kvm(index, "KVM_SET_SREGS"))?;
    // SAFETY: kemari enables no dynamically sized XSTATE features (AMX), so the
    // kernel's XSAVE area fits the 4096-byte `kvm_xsave` it reads from.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(kvm(index, "KVM_SET_XSAVE"))?;
    if !in_place
        .and_then(|p| p.xcrs.as_ref())
        .is_some_and(|x| same_xcrs(x, &state.xcrs))
    {
        fd.set_xcrs(&state.xcrs)
            .map_err(kvm(index, "KVM_SET_XCRS"))?;
    }
    if !in_place
        .and_then(|p| p.debugregs.as_ref())
        .is_some_and(|d| same_debugregs(d, &state.debugregs))
    {
        fd.set_debug_regs(&state.debugregs)
            .map_err(kvm(index, "KVM_SET_DEBUGREGS"))?;
    }
    fd.set_lapic(&state.lapic)
        .map_err(kvm(index, "KVM_SET_LAPIC"))?;
    let msrs: Vec<_> = state
        .msrs
        .iter()
        .filter(|m| !(m.index == MSR_KVM_POLL_CONTROL && m.data == 0))
        .copied()
        .collect();
    write_msrs(fd, index, &msrs)?;
    fd.set_vcpu_events(&state.events)
        .map_err(kvm(index, "KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// Writes `msrs`, skipping (and logging) any KVM refuses.
fn write_msrs(fd: &VcpuFd, index: u8, msrs: &[kvm_msr_entry]) -> Result<(), VcpuStateError> {
    let mut rest = msrs;
    while !rest.is_empty() {
        let batch = Msrs::from_entries(rest).map_err(|_| VcpuStateError::Invalid {
            index,
            what: "MSR list",
        })?;
        let n = fd.set_msrs(&batch).map_err(kvm(index, "KVM_SET_MSRS"))?;
        if n < rest.len() {
            tracing::debug!(
                vcpu = index,
                msr = format_args!("{:#x}", rest[n].index),
                "MSR not restored"
            );
        }
        rest = &rest[(n + 1).min(rest.len())..];
    }
    Ok(())
}
