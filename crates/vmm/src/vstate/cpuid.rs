//! CPUID as the guest sees it: what KVM supports, with per-vCPU topology and the
//! TSC frequency leaf (0x40000010) that lets a guest skip TSC calibration.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};
use kvm_ioctls::{Cap, Kvm};

const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
const TIMING_LEAF: u32 = 0x4000_0010;
/// CPUID.1:ECX bit 24: the LAPIC timer has TSC-deadline mode.
const TSC_DEADLINE_TIMER: u32 = 1 << 24;

/// The CPUID every vCPU of a VM kemari boots starts from (before
/// [`patch_for_vcpu`]): what KVM supports, the TSC-deadline timer if KVM
/// emulates it, and the timing leaf if the TSC rate is known.
///
/// KVM_GET_SUPPORTED_CPUID leaves the TSC-deadline bit out even when the
/// in-kernel LAPIC has that mode (KVM_CAP_TSC_DEADLINE_TIMER, api.rst):
/// QEMU, Firecracker and Cloud Hypervisor set it, and a Linux guest then
/// arms its timer with one MSR write instead of the LAPIC's one-shot
/// count-down (which it would otherwise calibrate).
pub fn base(kvm: &Kvm, tsc_khz: Option<u32>) -> Result<CpuId, kvm_ioctls::Error> {
    let mut cpuid = kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)?;
    if kvm.check_extension(Cap::TscDeadlineTimer) {
        add_tsc_deadline_timer(&mut cpuid);
    }
    add_timing_leaf(&mut cpuid, tsc_khz);
    Ok(cpuid)
}

/// Sets the TSC-deadline bit of leaf 1.
fn add_tsc_deadline_timer(cpuid: &mut CpuId) {
    for e in cpuid.as_mut_slice() {
        if e.function == 1 {
            e.ecx |= TSC_DEADLINE_TIMER;
        }
    }
}

/// Adds the timing leaf (TSC and bus frequency in kHz) if KVM knows the TSC rate.
fn add_timing_leaf(cpuid: &mut CpuId, tsc_khz: Option<u32>) {
    let Some(tsc_khz) = tsc_khz else { return };
    for e in cpuid.as_mut_slice() {
        if e.function == KVM_CPUID_SIGNATURE && e.eax < TIMING_LEAF {
            e.eax = TIMING_LEAF;
        }
    }
    let _ = cpuid.push(kvm_cpuid_entry2 {
        function: TIMING_LEAF,
        eax: tsc_khz,
        ebx: 1_000_000, // LAPIC bus: 1 GHz, KVM's nominal rate
        ..Default::default()
    });
}

/// Sets the APIC ID and logical-processor counts of vCPU `index` out of `vcpus`.
pub fn patch_for_vcpu(cpuid: &mut CpuId, index: u8, vcpus: u8) {
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (u32::from(index) << 24) | (u32::from(vcpus) << 16);
                e.ecx |= 1 << 31; // running on a hypervisor
                if vcpus > 1 {
                    e.edx |= 1 << 28; // HTT: the count in EBX[23:16] is valid
                }
            }
            0xb | 0x1f => e.edx = u32::from(index),
            _ => {}
        }
    }
}

/// Bits KVM rewrites from the vCPU's own registers whenever they change
/// (`kvm_update_cpuid_runtime`): a CPUID read from a running vCPU differs
/// from a freshly set one only there, and a restore's KVM_SET_SREGS,
/// KVM_SET_XCRS and KVM_SET_MSRS bring them up to date either way.
/// The masks of EAX, EBX, ECX and EDX of leaf (`function`, `index`) keep
/// the bits that count.
fn runtime_masks(function: u32, index: u32) -> [u32; 4] {
    const OSXSAVE: u32 = 1 << 27;
    const MWAIT: u32 = 1 << 3;
    const APIC: u32 = 1 << 9;
    const OSPKE: u32 = 1 << 4;
    match (function, index) {
        (1, _) => [!0, !0, !(OSXSAVE | MWAIT), !APIC],
        (7, 0) => [!0, !0, !OSPKE, !0],
        // The XSAVE area size for the enabled XCR0 / XSS features.
        (0xd, 0) | (0xd, 1) => [!0, 0, !0, !0],
        _ => [!0; 4],
    }
}

/// How CPUID `saved` differs from the CPUID `in_place` that kemari gave a
/// vCPU before the state arrived, the bits KVM keeps up to date itself
/// aside; `None` if it does not. A restore then skips KVM_SET_CPUID2, which
/// costs ~60 µs of the pause on a PVM host.
pub fn difference(saved: &[kvm_cpuid_entry2], in_place: &[kvm_cpuid_entry2]) -> Option<String> {
    if saved.len() != in_place.len() {
        return Some(format!(
            "{} leaves saved, {} in place",
            saved.len(),
            in_place.len()
        ));
    }
    let key = |e: &kvm_cpuid_entry2| (e.function, e.index);
    let mut a: Vec<_> = saved.iter().collect();
    let mut b: Vec<_> = in_place.iter().collect();
    a.sort_by_key(|e| key(e));
    b.sort_by_key(|e| key(e));
    a.iter().zip(&b).find_map(|(x, y)| {
        let m = runtime_masks(x.function, x.index);
        let same = key(x) == key(y)
            && x.flags == y.flags
            && x.eax & m[0] == y.eax & m[0]
            && x.ebx & m[1] == y.ebx & m[1]
            && x.ecx & m[2] == y.ecx & m[2]
            && x.edx & m[3] == y.edx & m[3];
        (!same).then(|| {
            format!(
                "leaf {:#x}.{}: saved {:#x} {:#x} {:#x} {:#x} flags {:#x}, in place leaf {:#x}.{}: {:#x} {:#x} {:#x} {:#x} flags {:#x}",
                x.function, x.index, x.eax, x.ebx, x.ecx, x.edx, x.flags,
                y.function, y.index, y.eax, y.ebx, y.ecx, y.edx, y.flags
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: regs[0],
            ebx: regs[1],
            ecx: regs[2],
            edx: regs[3],
            ..Default::default()
        }
    }

    #[test]
    fn equivalence_ignores_only_the_bits_kvm_updates_itself() {
        let fresh = vec![
            entry(0, 0, [0xd, 1, 2, 3]),
            entry(1, 0, [0x306a9, 0x0001_0800, 0x0000_0001, 0x0000_0001]),
            entry(7, 0, [0, 0x29c6f, 0, 0]),
            entry(0xd, 0, [7, 0x240, 0x340, 0]),
        ];
        // Read back after the guest enabled XSAVE and PKE, its APIC and
        // MWAIT changed; in another order.
        let mut running = vec![
            entry(0xd, 0, [7, 0x340, 0x340, 0]),
            entry(0, 0, [0xd, 1, 2, 3]),
            entry(1, 0, [0x306a9, 0x0001_0800, 0x0800_0009, 0x0000_0201]),
            entry(7, 0, [0, 0x29c6f, 1 << 4, 0]),
        ];
        assert_eq!(difference(&running, &fresh), None);
        // Anything else differs: a feature, the APIC ID, the XSAVE features,
        // a leaf more or less.
        let leaf1 = 2;
        running[leaf1].ecx |= 1 << 26;
        assert!(difference(&running, &fresh).is_some());
        running[leaf1].ecx &= !(1 << 26);
        running[leaf1].ebx = 0x0101_0800;
        assert!(difference(&running, &fresh).is_some());
        running[leaf1].ebx = 0x0001_0800;
        assert_eq!(difference(&running, &fresh), None);
        running[0].eax = 8;
        assert!(difference(&running, &fresh).is_some());
        running[0].eax = 7;
        assert_eq!(difference(&running, &fresh), None);
        running.pop();
        assert!(difference(&running, &fresh).is_some());
        running.push(entry(7, 1, [0, 0, 0, 0]));
        assert!(difference(&running, &fresh).is_some());
    }

    #[test]
    fn apic_id_and_timing_leaf() {
        let mut c = CpuId::from_entries(&[
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xffff_ffff,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: KVM_CPUID_SIGNATURE,
                eax: 0x4000_0001,
                ..Default::default()
            },
        ])
        .unwrap();
        patch_for_vcpu(&mut c, 3, 4);
        add_timing_leaf(&mut c, Some(2_000_000));
        add_tsc_deadline_timer(&mut c);
        let s = c.as_slice();
        assert_ne!(s[0].ecx & TSC_DEADLINE_TIMER, 0);
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_eq!(s[0].ebx & 0xffff, 0xffff);
        assert_eq!(s[1].eax, TIMING_LEAF);
        assert_eq!(s[2].function, TIMING_LEAF);
        assert_eq!(s[2].eax, 2_000_000);
    }
}
