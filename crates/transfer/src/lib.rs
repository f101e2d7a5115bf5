//! Moving a VM between kemari processes — live migration over TCP,
//! zero-copy migration on one host, warm restart into a prepared successor,
//! and the initial synchronization and epochs of fault tolerance — as small
//! modes on one layer:
//!
//! - [`channel`]: the handshake (key proofs), framing, authentication,
//!   sequence numbers, fds over a Unix socket;
//! - [`message`]: the one message set and its version;
//! - [`pages`]: the page codec (built in place, written with `pwritev`);
//! - [`precopy`]: the one pre-copy loop, with a pluggable [`precopy::StopRule`];
//! - [`source`] and [`destination`]: the one hand-over sequence, each end;
//! - [`modes`]: live, local, warm;
//! - [`cancel`], [`progress`]: cancelling before the commit point, and
//!   progress the API reads while the hand-over runs;
//! - [`streams`]: a live migration's extra page streams (`--connections`);
//! - [`error`]: the one error type, worded for the operator;
//! - [`listening`]: who is told that a destination listens;
//! - [`memory_digest`]: per-chunk digests of guest memory at the hand-over,
//!   to find lost pages (a debugging aid, off by default).
//!
//! docs/migration-protocol.md describes the exchanges.

pub mod cancel;
pub mod channel;
pub mod destination;
pub mod error;
pub mod faults;
pub mod key;
pub mod link;
pub mod listening;
pub mod memory_digest;
pub mod message;
pub mod modes;
pub mod net;
pub mod pages;
pub mod precopy;
pub mod progress;
pub mod source;
pub mod streams;
pub mod sys;
pub mod throttle;

pub use cancel::{Cancel, CancelOutcome};
pub use error::{Peer, TransferError};
pub use progress::{Progress, ProgressCell};
