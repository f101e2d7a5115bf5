//! kemari-nbd: an NBD target server and a relocation proxy (xNBD-style
//! copy-on-read with a prioritized background copy), plus a blocking NBD
//! client for the VMM. See docs/nbd.md.

pub mod backend;
pub mod client;
pub mod control;
pub mod ext;
pub mod loadgen;
pub mod page_buf;
pub mod protocol;
pub mod proxy;
pub mod relay;
pub mod server;
pub mod splice;
