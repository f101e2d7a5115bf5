//! The `kemari` VMM process (one VM per process) and its control API.

pub mod api;
pub mod cli;
pub mod teardown;
pub mod vmm_process;
