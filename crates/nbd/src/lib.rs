//! kemari-nbd: an NBD target server and a relocation proxy (xNBD-style
//! copy-on-read with a prioritized background copy). The NBD client, the
//! wire codec and page-aligned buffers live in the `nbd-client` crate, which
//! the VMM links alone; they are re-exported here under their old paths.
//! See docs/nbd.md.

pub mod allow;
pub mod backend;
pub mod cli;
pub mod control;
pub mod ext;
pub mod loadgen;
pub mod metrics;
pub mod notify;
pub mod proxy;
pub mod relay;
pub mod server;
pub mod shutdown;
pub mod splice;
pub mod tls;
pub mod watch;

pub use nbd_client::{client, page_buf, protocol};
