//! The hand-over modes: each a small module on the shared channel, message
//! set, pre-copy loop and sequences. Fault tolerance, the fourth, is its
//! own crate (`crates/ft`) on the same pieces.

pub mod live;
pub mod local;
pub mod warm;
