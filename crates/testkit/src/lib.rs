//! What the integration tests share: the binaries under test, scratch
//! folders, child processes and waiting, the PVH stub kernel and the test
//! guest, TAP devices and bridges, and the guest-under-load scenario of the
//! availability tests. A `[dev-dependencies]` entry only; never shipped.
//!
//! - [`bins`]: `kemari` and `kemarictl` (found beside the test executable,
//!   see there), the test guest's ELF, binaries of other packages;
//! - [`dirs`]: scratch folders, reading a file that may not exist yet;
//! - [`etcd`]: a real etcd cluster of a few members on localhost ports;
//! - [`http`]: raw HTTP exchanges with the API, control and metrics
//!   endpoints, and a `/metrics` scrape checked by promtool;
//! - [`procs`]: children killed on drop, timeouts, polling, tools on PATH;
//! - [`stub`]: the PVH stub kernel (`fixtures/pvh-stub.S`);
//! - [`net`]: free ports, TAP devices and bridges, the TCP echo checker, the
//!   test guest's `GET /reboot`;
//! - [`notify`]: a test-owned `NOTIFY_SOCKET` (systemd's readiness);
//! - [`scenario`]: the test guest counting, writing its disk and echoing TCP,
//!   and the checks that it went on across an operation.
//!
//! What a test needs from the machine (KVM, TAP, tools) is probed when its
//! crate is built; a test that cannot run is reported ignored with the
//! reason (the `kemari-test-probe` crate in `probe/`).

pub mod bins;
pub mod dirs;
pub mod etcd;
pub mod http;
pub mod net;
pub mod notify;
pub mod procs;
pub mod promtool;
pub mod relay;
pub mod scenario;
pub mod stub;

pub use bins::{guest_elf, kemari, kemarictl};
pub use dirs::{log_without_escapes, read_text, scratch, test_key, write_key, TempDir, TEST_KEY};
pub use etcd::EtcdCluster;
pub use net::{
    ask_guest_reboot, free_port, listening, wait_listening, wait_port, AnnounceCapture, Bridge,
    EchoChecker, TapNet,
};
pub use notify::NotifySocket;
pub use procs::{
    assert_every_thread_filtered, assert_quiet_on_closed_stdout, assert_verbose_log_filter_refused,
    run, run_with_timeout, sh, thread_seccomp, tool, wait_exit, wait_for, FaultHold, KillOnDrop,
    ThreadSeccomp,
};
pub use promtool::{promtool_check, sample_sum, samples};
pub use relay::Relay;
pub use stub::{build_stub, build_stub_mode};
