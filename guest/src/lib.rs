//! Pure logic of kemari's test guest, kept apart from the hardware code so it
//! can be unit-tested on the host (`cargo test -p guest --lib`): the kernel
//! command-line parser, the self-checking disk block and pmem window formats
//! HTTP request routing and the echo connections' TCP buffer sizes.
#![cfg_attr(not(test), no_std)]

pub mod blockfmt;
pub mod cmdline;
pub mod httpreq;
pub mod num;
pub mod pmemfmt;
pub mod tcpbuf;
