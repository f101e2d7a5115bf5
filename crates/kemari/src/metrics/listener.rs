//! `--metrics-listen ADDR`: `GET /metrics` over TCP for a Prometheus server
//! that cannot reach the API's Unix socket. The listener itself is
//! kemari-api's ([`kemari_api::metrics_listener`], shared with kemari-nbd);
//! here it serves this VMM's exposition, its thread under the API threads'
//! seccomp filter (the socket is bound at start-up, before the VMM confines
//! itself).

use std::sync::Arc;

pub use kemari_api::metrics_listener::{ListenError, MetricsListener, DEADLINE, MAX_REQUEST};

use crate::controller::shared::Shared;

/// Serves `shared`'s metrics on `listener`'s thread for the rest of the
/// process's life.
pub(crate) fn serve(listener: MetricsListener, shared: Arc<Shared>) -> Result<(), ListenError> {
    listener.serve(
        Arc::new(move || (super::CONTENT_TYPE, super::exposition(&shared))),
        || vmm::seccomp::confine_this_thread(vmm::seccomp::ThreadFilter::Api),
    )
}
