//! Checking a Prometheus exposition the way Prometheus does: `promtool
//! check metrics` (Debian package `prometheus`, installed by
//! scripts/setup.sh), and reading its samples back.

use std::io::Write;
use std::process::{Command, Stdio};

/// `promtool check metrics` on `text`; fails (never skips) without promtool.
pub fn promtool_check(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): run scripts/setup.sh (it installs the Debian package \
                 `prometheus`, which has promtool)"
            )
        });
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool's answer");
    assert!(
        out.status.success(),
        "promtool check metrics refused the exposition:\n{}{}\n--- exposition:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The samples of `text`: (name, labels as written, value).
pub fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample's value");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|e| panic!("{l}: {e}")),
            };
            (name.to_owned(), labels.to_owned(), value)
        })
        .collect()
}

/// The sum of the samples named `name` whose labels hold every one of `with`.
pub fn sample_sum(text: &str, name: &str, with: &[&str]) -> f64 {
    samples(text)
        .iter()
        .filter(|(n, l, _)| n == name && with.iter().all(|w| l.contains(w)))
        .map(|(_, _, v)| v)
        .sum()
}
