//! Probes what the tests need (unit tests of TAP devices, KVM tests); see
//! `kemari-test-probe`.

use kemari_test_probe::{probe, Need};

fn main() {
    probe(&[Need::Kvm, Need::Tap]);
}
