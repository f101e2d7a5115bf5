//! `GET /vm` latency behind idle and slow clients, against any kemari API
//! socket (docs/api.md):
//!
//! ```sh
//! cargo run -p kemari-api --example latency -- SOCKET [IDLE [SLOW [REQUESTS [TIMEOUT_S]]]]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use kemari_api::latency::{probe, ProbeOptions};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(socket) = args.first().map(PathBuf::from) else {
        eprintln!("usage: latency SOCKET [IDLE [SLOW [REQUESTS [TIMEOUT_S]]]]");
        return ExitCode::from(2);
    };
    let number =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let mut options = ProbeOptions::new(number(1, 1000), number(2, 1), number(3, 20));
    options.request_timeout = Duration::from_secs(number(4, 30) as u64);
    match probe(&socket, &options) {
        Ok(report) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("latency: {e}");
            ExitCode::from(1)
        }
    }
}
