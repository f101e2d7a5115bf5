//! Probes what the integration tests need; see `kemari-test-probe`.

use kemari_test_probe::{probe, Need};

fn main() {
    probe(&[
        Need::Kvm,
        Need::Tap,
        Need::Tool("etcd"),
        Need::Tool("etcdctl"),
        Need::Tool("ocf-tester"),
        Need::Tool("openssl"),
        Need::Tool("chromium"),
    ]);
}
