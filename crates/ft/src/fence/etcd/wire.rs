//! What the VMM and its etcd helper process say to each other: one line
//! per message on a socket pair.
//!
//! ```text
//!  VMM                                   helper
//!   │── acquire start|failover ──────────▶│ grant a lease, put the key if absent
//!   │◀───────────────── held DEADLINE_NS ──│   (or: failed WHY)
//!   │◀────────────── renewed DEADLINE_NS ──│ every TTL/3
//!   │◀───────────────────────── lost WHY ──│ etcd says the lease is gone
//!   │── release ──────────────────────────▶│ revoke the lease, exit
//! ```

/// Why the key is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A primary starting: waits out a previous copy's lease, then gives up.
    Start,
    /// A standby failing over: waits while etcd cannot be reached; gives
    /// up only once it has seen the holder renew its lease.
    Failover,
}

/// VMM → helper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Take the key.
    Acquire(Purpose),
    /// Give the lease back (the VM ended here) and exit.
    Release,
}

/// Helper → VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The key is ours until this `CLOCK_MONOTONIC` time (ns).
    Held(u64),
    /// Renewed: ours until then.
    Renewed(u64),
    /// Not taken, and why.
    Failed(String),
    /// The lease is gone (etcd says so).
    Lost(String),
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

impl Request {
    /// The line (with its newline).
    pub fn line(&self) -> String {
        match self {
            Request::Acquire(Purpose::Start) => "acquire start\n".into(),
            Request::Acquire(Purpose::Failover) => "acquire failover\n".into(),
            Request::Release => "release\n".into(),
        }
    }

    /// Parses a line (newline trimmed or not).
    pub fn parse(line: &str) -> Option<Request> {
        match line.trim_end() {
            "acquire start" => Some(Request::Acquire(Purpose::Start)),
            "acquire failover" => Some(Request::Acquire(Purpose::Failover)),
            "release" => Some(Request::Release),
            _ => None,
        }
    }
}

impl Report {
    /// The line (with its newline).
    pub fn line(&self) -> String {
        match self {
            Report::Held(d) => format!("held {d}\n"),
            Report::Renewed(d) => format!("renewed {d}\n"),
            Report::Failed(why) => format!("failed {}\n", one_line(why)),
            Report::Lost(why) => format!("lost {}\n", one_line(why)),
        }
    }

    /// Parses a line (newline trimmed or not).
    pub fn parse(line: &str) -> Option<Report> {
        let (word, rest) = line.trim_end().split_once(' ')?;
        match word {
            "held" => rest.parse().ok().map(Report::Held),
            "renewed" => rest.parse().ok().map(Report::Renewed),
            "failed" => Some(Report::Failed(rest.to_owned())),
            "lost" => Some(Report::Lost(rest.to_owned())),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        for r in [
            Request::Acquire(Purpose::Start),
            Request::Acquire(Purpose::Failover),
            Request::Release,
        ] {
            assert_eq!(Request::parse(&r.line()), Some(r));
        }
        for r in [
            Report::Held(12),
            Report::Renewed(u64::MAX),
            Report::Failed("held by x".into()),
            Report::Lost("gone".into()),
        ] {
            assert_eq!(Report::parse(&r.line()), Some(r));
        }
        assert_eq!(
            Report::parse(&Report::Failed("a\nb".into()).line()),
            Some(Report::Failed("a b".into()))
        );
        assert_eq!(Report::parse("held x"), None);
        assert_eq!(Request::parse("acquire"), None);
    }
}
