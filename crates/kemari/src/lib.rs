//! The `kemari` VMM process (one VM per process): its command line, its
//! controller (the main loop and the workers of long operations) and its
//! operations; its control API is the `kemari-api` crate, re-exported as
//! [`api`].

pub use kemari_api as api;
pub mod agent_cli;
pub mod cli;
pub mod controller;
pub mod ctl;
pub mod events;
pub mod identity;
pub mod metrics;
pub mod notify;
pub mod operation;
pub mod sys;
