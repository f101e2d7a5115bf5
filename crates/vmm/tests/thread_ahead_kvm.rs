//! A vCPU thread made ahead of a restore against real KVM: its first
//! KVM_RUN of the vCPU, made before the restore, enters no guest (KVM
//! answers EINTR, as for a run cut short) and leaves `immediate_exit` as it
//! was; it is refused for a vCPU of another index.

use vmm::vstate::vcpu::{Vcpu, VcpuError, VcpuThreadAhead};
use vmm::vstate::vm::Vm;

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn the_first_run_ahead_enters_no_guest_and_only_for_its_own_vcpu() {
    let vm = Vm::new().unwrap();
    let mut vcpu = Vcpu::new(vm.fd(), 0).unwrap();
    let mut other = Vcpu::new(vm.fd(), 1).unwrap();
    let thread = VcpuThreadAhead::spawn(0).unwrap();

    // EINTR, or it is an error: no memory, no registers set, a guest entry
    // would have failed.
    thread.first_run(&mut vcpu).unwrap();
    let run = vcpu.fd().get_kvm_run();
    assert_eq!(run.immediate_exit, 0);
    assert_eq!(run.exit_reason, 0, "no exit: the guest was never entered");

    assert!(matches!(
        thread.first_run(&mut other),
        Err(VcpuError::WrongThread { vcpu: 1, thread: 0 })
    ));
}
