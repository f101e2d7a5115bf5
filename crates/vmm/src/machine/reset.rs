//! The power-on state of a VM's vCPUs and in-kernel devices, for a reboot
//! that keeps its KVM VM: KVM has no "reset this vCPU" ioctl, and a vCPU
//! lives as long as its VM, so the reboot writes over every vCPU (and the
//! irqchip, PIT and clock) the state a VM KVM has just made holds — read
//! from a scratch VM made for the purpose, whose vCPUs are configured as a
//! boot configures them ([`Vcpu::configure`]). Everything a guest can leave
//! behind in a vCPU goes with it: registers, LAPIC, pending events, run
//! state, and the MSRs by which it had KVM write into its memory (kvmclock,
//! steal time, async page faults, PV EOI), which KVM would otherwise keep
//! writing into the new boot's memory.

use kvm_bindings::{Msrs, KVM_MAX_CPUID_ENTRIES};

use super::setup::configured_vcpu;
use super::MachineError;
use crate::persist::vcpu::{self as vcpu_state, InPlace, VcpuState};
use crate::persist::KvmVmState;
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::{Vm, VmError};

/// The local APIC's base and mode (xAPIC, x2APIC).
const MSR_IA32_APICBASE: u32 = 0x1b;

/// What a new VM of `vcpus` vCPUs holds before its first run.
pub(super) struct PowerOnState {
    vcpus: Vec<VcpuState>,
    kvm: KvmVmState,
}

impl PowerOnState {
    /// Reads it from a scratch VM (no memory; a few ms).
    pub(super) fn read(vcpus: u8) -> Result<Self, MachineError> {
        let scratch = Vm::new()?;
        let msrs = vcpu_state::msr_indices(scratch.kvm()).map_err(|source| VmError::Kvm {
            what: "KVM_GET_MSR_INDEX_LIST",
            source,
        })?;
        let mut base = None;
        let mut states = Vec::with_capacity(usize::from(vcpus));
        for i in 0..vcpus {
            let mut vcpu = configured_vcpu(&scratch, i, vcpus, &mut base)?;
            states.push(vcpu_state::save(vcpu.fd(), i, &msrs).map_err(MachineError::VcpuState)?);
        }
        let kvm = KvmVmState::save(scratch.fd()).map_err(MachineError::VmState)?;
        Ok(PowerOnState { vcpus: states, kvm })
    }

    /// Writes it over `vm` and its `vcpus` (stopped, in index order).
    pub(super) fn write(&self, vm: &Vm, vcpus: &mut [Vcpu]) -> Result<(), MachineError> {
        if vcpus.len() != self.vcpus.len() {
            return Err(MachineError::InvalidState(format!(
                "{} vCPUs to reset, the power-on state has {}",
                vcpus.len(),
                self.vcpus.len()
            )));
        }
        for (vcpu, state) in vcpus.iter_mut().zip(&self.vcpus) {
            let index = vcpu.index();
            // KVM refuses a different CPUID once a vCPU has run: the one it
            // holds is compared with the power-on one and kept if the same.
            let held = vcpu
                .fd()
                .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
                .map_err(|source| {
                    MachineError::VcpuState(vcpu_state::VcpuStateError::Kvm {
                        index,
                        what: "KVM_GET_CPUID2",
                        source,
                    })
                })?;
            let in_place = InPlace {
                cpuid: Some(held.as_slice().to_vec()),
                ..InPlace::default()
            };
            // The APIC's mode first: KVM reads the LAPIC state written next
            // in the mode the vCPU is in, and a guest left it in x2APIC mode.
            if let Some(base) = state.msrs.iter().find(|m| m.index == MSR_IA32_APICBASE) {
                let msrs = Msrs::from_entries(&[*base]).map_err(|_| {
                    MachineError::VcpuState(vcpu_state::VcpuStateError::Invalid {
                        index,
                        what: "MSR list",
                    })
                })?;
                vcpu.fd().set_msrs(&msrs).map_err(|source| {
                    MachineError::VcpuState(vcpu_state::VcpuStateError::Kvm {
                        index,
                        what: "KVM_SET_MSRS (APIC base)",
                        source,
                    })
                })?;
            }
            vcpu_state::restore(vcpu.fd(), state, Some(&in_place))
                .map_err(MachineError::VcpuState)?;
        }
        self.kvm.restore(vm.fd()).map_err(MachineError::VmState)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether KVM is here; says so visibly when it is not.
    fn kvm_here() -> bool {
        let here = std::path::Path::new("/dev/kvm").exists();
        if !here {
            eprintln!("SKIPPED: no /dev/kvm");
        }
        here
    }

    /// The MSR by which a guest has KVM write its kvmclock into its memory.
    const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;

    fn msr(vcpu: &mut Vcpu, index: u32) -> u64 {
        let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .unwrap();
        assert_eq!(vcpu.fd().get_msrs(&mut msrs).unwrap(), 1);
        msrs.as_slice()[0].data
    }

    #[test]
    fn a_vcpu_a_guest_left_behind_reads_as_at_power_on() {
        if !kvm_here() {
            return;
        }
        let power_on = PowerOnState::read(2).unwrap();
        let vm = Vm::new().unwrap();
        let mut base = None;
        let mut vcpus: Vec<Vcpu> = (0..2)
            .map(|i| configured_vcpu(&vm, i, 2, &mut base).unwrap())
            .collect();
        // What a guest leaves: registers, a kvmclock page, a pending NMI.
        let fd = vcpus[0].fd();
        let mut regs = fd.get_regs().unwrap();
        regs.rip = 0x1234_5678;
        regs.rax = 42;
        fd.set_regs(&regs).unwrap();
        let kvmclock = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: MSR_KVM_SYSTEM_TIME_NEW,
            data: 0x10_0001,
            ..Default::default()
        }])
        .unwrap();
        assert_eq!(fd.set_msrs(&kvmclock).unwrap(), 1);
        assert_eq!(msr(&mut vcpus[0], MSR_KVM_SYSTEM_TIME_NEW), 0x10_0001);
        // Its LAPIC in x2APIC mode (as Linux leaves it on KVM).
        let base = msr(&mut vcpus[0], MSR_IA32_APICBASE);
        let x2apic = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: MSR_IA32_APICBASE,
            data: base | (1 << 10),
            ..Default::default()
        }])
        .unwrap();
        assert_eq!(vcpus[0].fd().set_msrs(&x2apic).unwrap(), 1);
        let mut events = vcpus[0].fd().get_vcpu_events().unwrap();
        events.nmi.pending = 1;
        events.flags |= kvm_bindings::KVM_VCPUEVENT_VALID_NMI_PENDING;
        vcpus[0].fd().set_vcpu_events(&events).unwrap();

        power_on.write(&vm, &mut vcpus).unwrap();

        let fd = vcpus[0].fd();
        let regs = fd.get_regs().unwrap();
        assert_eq!((regs.rip, regs.rax), (0xfff0, 0), "registers at reset");
        assert_eq!(fd.get_vcpu_events().unwrap().nmi.pending, 0);
        assert_eq!(
            msr(&mut vcpus[0], MSR_KVM_SYSTEM_TIME_NEW),
            0,
            "kvmclock off"
        );
        assert_eq!(msr(&mut vcpus[0], MSR_IA32_APICBASE), base, "xAPIC mode");
        let lapic = vcpus[0].fd().get_lapic().unwrap();
        assert_eq!(
            lapic.regs[..0x400],
            power_on.vcpus[0].lapic.regs[..0x400],
            "the LAPIC's registers (its ID among them) as at power-on"
        );
        // The second vCPU waits for its INIT and SIPI again.
        assert_eq!(
            vcpus[1].fd().get_mp_state().unwrap().mp_state,
            kvm_bindings::KVM_MP_STATE_UNINITIALIZED
        );
    }

    #[test]
    fn a_different_vcpu_count_is_refused() {
        if !kvm_here() {
            return;
        }
        let power_on = PowerOnState::read(1).unwrap();
        let vm = Vm::new().unwrap();
        let mut vcpus: Vec<Vcpu> = (0..2).map(|i| Vcpu::new(vm.fd(), i).unwrap()).collect();
        assert!(matches!(
            power_on.write(&vm, &mut vcpus),
            Err(MachineError::InvalidState(_))
        ));
    }
}
