//! A vCPU made ahead against real KVM: a restore into a vCPU whose CPUID was
//! preset skips KVM_SET_CPUID2 only when the saved CPUID is the one in
//! place, and sets the saved one otherwise; the same holds for the other
//! parts read back ahead (run state, XCRs, debug registers); a pending NMI
//! survives a save and restore.

use kvm_bindings::{kvm_cpuid_entry2, KVM_MAX_CPUID_ENTRIES};
use vmm::persist;
use vmm::vstate::cpuid;
use vmm::vstate::vcpu::Vcpu;
use vmm::vstate::vm::Vm;

const TIMING_LEAF: u32 = 0x4000_0010;

/// A vCPU with kemari's boot CPUID preset, as a migration destination makes
/// it before the state arrives.
fn preset_vcpu(vm: &Vm, index: u8) -> Vcpu {
    let base = cpuid::base(vm.kvm(), Some(2_000_000)).unwrap();
    let mut vcpu = Vcpu::new(vm.fd(), index).unwrap();
    vcpu.preset_cpuid(&base, 1).unwrap();
    vcpu
}

fn cpuid_of(vcpu: &mut Vcpu) -> Vec<kvm_cpuid_entry2> {
    vcpu.fd()
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .unwrap()
        .as_slice()
        .to_vec()
}

fn timing_eax(entries: &[kvm_cpuid_entry2]) -> u32 {
    entries
        .iter()
        .find(|e| e.function == TIMING_LEAF)
        .expect("the timing leaf")
        .eax
}

/// The saved state of a vCPU with kemari's boot CPUID, in a VM of its own.
fn saved_preset_vcpu() -> persist::VcpuState {
    let vm = Vm::new().unwrap();
    let mut source = preset_vcpu(&vm, 0);
    let indices = vm.kvm().get_msr_index_list().unwrap().as_slice().to_vec();
    persist::vcpu::save(source.fd(), 0, &indices).unwrap()
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_preset_cpuid_is_kept_only_when_it_is_the_saved_one() {
    let mut state = saved_preset_vcpu();
    assert_eq!(timing_eax(&state.cpuid), 2_000_000);

    // The same CPUID: kept (and, read back, still the saved one).
    let other = Vm::new().unwrap();
    let mut same = preset_vcpu(&other, 0);
    let in_place = same.take_in_place().expect("preset");
    assert_eq!(
        cpuid::difference(&state.cpuid, in_place.cpuid.as_deref().unwrap()),
        None
    );
    persist::vcpu::restore(same.fd(), &state, Some(&in_place)).unwrap();
    assert_eq!(cpuid::difference(&state.cpuid, &cpuid_of(&mut same)), None);

    // A CPUID that differs (another TSC rate in the timing leaf): the saved
    // one is set, not the one in place.
    let changed = &mut state;
    for e in &mut changed.cpuid {
        if e.function == TIMING_LEAF {
            e.eax = 1_234_567;
        }
    }
    let third = Vm::new().unwrap();
    let mut differs = preset_vcpu(&third, 0);
    let in_place = differs.take_in_place().expect("preset");
    assert!(cpuid::difference(&changed.cpuid, in_place.cpuid.as_deref().unwrap()).is_some());
    persist::vcpu::restore(differs.fd(), changed, Some(&in_place)).unwrap();
    let now = cpuid_of(&mut differs);
    assert_eq!(timing_eax(&now), 1_234_567);
    assert_eq!(cpuid::difference(&changed.cpuid, &now), None);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_restore_writes_what_differs_from_the_vcpu_made_ahead_and_skips_nothing_else() {
    let mut state = saved_preset_vcpu();
    // A fresh vCPU's breakpoint registers are 0: this one differs, and the
    // restore must write it although the rest of the debug registers match.
    state.debugregs.db[0] = 0x1000;

    let other = Vm::new().unwrap();
    let mut ahead = preset_vcpu(&other, 0);
    ahead.read_in_place();
    let in_place = ahead.take_in_place().expect("read ahead");
    assert_eq!(in_place.debugregs.map(|d| d.db[0]), Some(0));
    let mp = in_place.mp_state.expect("run state read ahead");
    assert_eq!(mp.mp_state, state.mp_state.mp_state);
    persist::vcpu::restore(ahead.fd(), &state, Some(&in_place)).unwrap();

    let debugregs = ahead.fd().get_debug_regs().unwrap();
    assert_eq!(debugregs.db[0], 0x1000);
    assert_eq!(debugregs.dr7, state.debugregs.dr7);
    let xcrs = ahead.fd().get_xcrs().unwrap();
    assert_eq!(xcrs.nr_xcrs, state.xcrs.nr_xcrs);
    for (now, saved) in xcrs
        .xcrs
        .iter()
        .zip(&state.xcrs.xcrs)
        .take(xcrs.nr_xcrs as usize)
    {
        assert_eq!((now.xcr, now.value), (saved.xcr, saved.value));
    }
    assert_eq!(
        ahead.fd().get_mp_state().unwrap().mp_state,
        state.mp_state.mp_state
    );
}

/// KVM_GET_VCPU_EVENTS marks the pending NMI valid itself (QEMU adds the
/// flag by hand for older kernels): a pending NMI crosses a hand-over.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_pending_nmi_survives_a_save_and_restore() {
    let vm = Vm::new().unwrap();
    let mut source = preset_vcpu(&vm, 0);
    let mut events = source.fd().get_vcpu_events().unwrap();
    events.nmi.pending = 1;
    events.flags |= kvm_bindings::KVM_VCPUEVENT_VALID_NMI_PENDING;
    source.fd().set_vcpu_events(&events).unwrap();
    let indices = vm.kvm().get_msr_index_list().unwrap().as_slice().to_vec();
    let state = persist::vcpu::save(source.fd(), 0, &indices).unwrap();
    assert_eq!(
        state.events.nmi.pending, 1,
        "the save reads the pending NMI"
    );

    let other = Vm::new().unwrap();
    let mut restored = Vcpu::new(other.fd(), 0).unwrap();
    persist::vcpu::restore(restored.fd(), &state, None).unwrap();
    let now = restored.fd().get_vcpu_events().unwrap();
    assert_eq!(
        now.nmi.pending, 1,
        "the pending NMI was dropped at the restore"
    );
}

/// A vCPU set up for boot has what firmware gives a kernel: the TSC-deadline
/// timer (when KVM emulates it) and MTRRs on with write-back as the default;
/// the saved state carries the MTRR default type to a restored vCPU.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_booted_vcpu_has_the_tsc_deadline_timer_and_write_back_mtrrs_and_keeps_them() {
    const MTRR_DEF_TYPE: u32 = 0x2ff;
    let vm = Vm::new().unwrap();
    let base = cpuid::base(vm.kvm(), None).unwrap();
    let mut vcpu = Vcpu::new(vm.fd(), 0).unwrap();
    vcpu.configure(&base, 1).unwrap();
    let leaf1 = cpuid_of(&mut vcpu)
        .into_iter()
        .find(|e| e.function == 1)
        .expect("leaf 1");
    if vm.kvm().check_extension(kvm_ioctls::Cap::TscDeadlineTimer) {
        assert_ne!(leaf1.ecx & (1 << 24), 0, "no TSC-deadline timer in CPUID");
    } else {
        eprintln!("SKIPPED (TSC-deadline part): this KVM has no KVM_CAP_TSC_DEADLINE_TIMER");
    }
    let indices = persist::vcpu::msr_indices(vm.kvm()).unwrap();
    assert!(indices.contains(&MTRR_DEF_TYPE));
    let state = persist::vcpu::save(vcpu.fd(), 0, &indices).unwrap();
    let saved = state.msrs.iter().find(|m| m.index == MTRR_DEF_TYPE);
    assert_eq!(
        saved.map(|m| m.data),
        Some((1 << 11) | 6),
        "MTRRs on, write-back"
    );

    let other = Vm::new().unwrap();
    let mut restored = Vcpu::new(other.fd(), 0).unwrap();
    persist::vcpu::restore(restored.fd(), &state, None).unwrap();
    let mut read = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MTRR_DEF_TYPE,
        ..Default::default()
    }])
    .unwrap();
    assert_eq!(restored.fd().get_msrs(&mut read).unwrap(), 1);
    assert_eq!(read.as_slice()[0].data, (1 << 11) | 6);
}
