//! What the KVM tests of this crate share.

/// Whether /dev/kvm can be opened here; if not, says that the test is skipped.
pub fn have_kvm() -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        eprintln!("SKIP: /dev/kvm is not usable here");
    }
    ok
}
