//! Probes the NBD clients the integration tests drive; see `kemari-test-probe`.

use kemari_test_probe::{probe, Need};

fn main() {
    probe(&[
        Need::Tool("nbdinfo"),
        Need::Tool("nbdcopy"),
        Need::Tool("qemu-img"),
        Need::Tool("qemu-io"),
        Need::Tool("qemu-nbd"),
        Need::Tool("mkfs.ext4"),
        Need::Tool("openssl"),
        Need::FioNbd,
    ]);
}
