//! Moving a running VM to another VMM process.

pub mod local;
pub mod tcp;
pub mod warm;
pub mod wire;
