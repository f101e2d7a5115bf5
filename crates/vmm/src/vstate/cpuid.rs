//! CPUID as the guest sees it: what KVM supports, with per-vCPU topology and the
//! TSC frequency leaf (0x40000010) that lets a guest skip TSC calibration.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
const TIMING_LEAF: u32 = 0x4000_0010;

/// Adds the timing leaf (TSC and bus frequency in kHz) if KVM knows the TSC rate.
pub fn add_timing_leaf(cpuid: &mut CpuId, tsc_khz: Option<u32>) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let s = c.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_eq!(s[0].ebx & 0xffff, 0xffff);
        assert_eq!(s[1].eax, TIMING_LEAF);
        assert_eq!(s[2].function, TIMING_LEAF);
        assert_eq!(s[2].eax, 2_000_000);
    }
}
