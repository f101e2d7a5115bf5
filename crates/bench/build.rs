//! Probes what the unit tests need; see `kemari-test-probe`.

use kemari_test_probe::{probe, Need};

fn main() {
    probe(&[Need::Kvm]);
}
