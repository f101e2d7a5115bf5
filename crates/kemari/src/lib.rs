//! The `kemari` VMM process (one VM per process); its control API is the
//! `kemari-api` crate, re-exported as [`api`].

pub use kemari_api as api;
pub mod cli;
pub mod teardown;
pub mod vmm_process;
