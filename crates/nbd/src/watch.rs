//! `kemari-nbd status --watch`: a proxy's background copy followed to its
//! cut-over — kemari-logging's progress display on stdout (a bar on a
//! terminal, a line a second otherwise) fed from the control socket's
//! status every [`EVERY`].

use std::path::Path;
use std::time::Duration;

use kemari_logging::progress::{ProgressDisplay, Step};
use serde_json::Value;
use thiserror::Error;

use crate::control;

/// How often the status is asked for.
pub const EVERY: Duration = Duration::from_millis(500);

#[derive(Debug, Error)]
pub enum WatchError {
    #[error("cannot ask the proxy at {path} (--control): {cause}")]
    Control {
        path: String,
        #[source]
        cause: std::io::Error,
    },
    #[error("the proxy refused the status request: {0}")]
    Refused(String),
}

/// Follows the proxy at `control` until it has cut over.
pub fn run(path: &Path) -> Result<(), WatchError> {
    let mut display = ProgressDisplay::on_stdout();
    loop {
        let reply = control::request(path, "status").map_err(|cause| WatchError::Control {
            path: path.display().to_string(),
            cause,
        })?;
        if reply["ok"] != true {
            display.finish();
            return Err(WatchError::Refused(reply["error"].to_string()));
        }
        let status = &reply["status"];
        display.show(step(status));
        if status["cut_over"] == true {
            display.finish_and_keep();
            return Ok(());
        }
        std::thread::sleep(EVERY);
    }
}

/// The step a status shows: the phase, blocks held locally of all, rates.
fn step(s: &Value) -> Step {
    let mb_s = |key: &str| s[key].as_f64().unwrap_or(0.0) / 1e6;
    let mut message = format!(
        "background {:.1} MB/s, on demand {:.1} MB/s",
        mb_s("background_rate_bytes_per_sec"),
        mb_s("ondemand_rate_bytes_per_sec")
    );
    if s["paused"] == true {
        message.push_str(", paused");
    }
    Step {
        prefix: format!("proxy of {}", s["upstream"].as_str().unwrap_or("?")),
        step: s["phase"].as_str().unwrap_or("?").to_owned(),
        done: s["cached_blocks"].as_u64().unwrap_or(0),
        total: s["blocks"].as_u64().unwrap_or(0),
        unit: "blocks",
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_status_is_its_phase_blocks_and_rates() {
        let s = json!({
            "upstream": "nbd://10.0.0.1:10809/disk", "phase": "copying",
            "cached_blocks": 1024, "blocks": 4096, "paused": true,
            "background_rate_bytes_per_sec": 12_500_000.0,
            "ondemand_rate_bytes_per_sec": 0.0,
        });
        assert_eq!(
            step(&s).line(),
            "proxy of nbd://10.0.0.1:10809/disk: copying: 1024/4096 blocks (25%) \
             background 12.5 MB/s, on demand 0.0 MB/s, paused"
        );
    }
}
