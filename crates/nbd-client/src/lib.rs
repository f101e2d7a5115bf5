//! nbd-client: a blocking NBD client (fixed newstyle, structured replies,
//! pipelined requests), the NBD wire codec it speaks and page-aligned
//! request buffers. The VMM's virtio-blk backend links this alone;
//! `kemari-nbd` (server, relocation proxy, CLI) builds on it. See docs/nbd.md.

pub mod client;
pub mod page_buf;
pub mod protocol;
pub mod read_reply;
