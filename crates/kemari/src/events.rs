//! The VM's events (`GET /vm/events`, `--events-file`): one JSON object per
//! line, each with its time, the VM's id and name and its kind —
//!
//! ```text
//! {"timestamp":"2026-11-25T10:00:00.123456Z","vm":"3f9c0a1b2c3d4e5f","name":"web1","event":"paused","by":"api"}
//! ```
//!
//! The controller publishes; every subscriber (an API stream, the events
//! file's writer) has a bounded queue of its own. Publishing never waits
//! for one: a subscriber whose queue is full loses the event, and the
//! next line it gets (or its last, when the hub closes) is
//! `{"event":"events_lost","count":N}`. At the end the hub closes: each
//! queue ends after what it already holds, so a follower reads the last
//! event (`shutdown`, the `operation_completed` of a hand-over) and then
//! the end of its stream.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde_json::Value;

/// Lines a subscriber may have queued before it loses events.
pub const QUEUE_LINES: usize = 256;

/// Where the events go.
#[derive(Debug, Default)]
pub struct EventHub {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    id: Option<String>,
    name: Option<String>,
    subscribers: Vec<Subscriber>,
    /// The events file's writer says on this that it ended.
    writers: Vec<Receiver<()>>,
    closed: bool,
}

#[derive(Debug)]
struct Subscriber {
    tx: SyncSender<String>,
    /// Events it lost since its last line.
    lost: u64,
}

impl Subscriber {
    /// Sends `line`, after the count of what was lost if anything was;
    /// false once the subscriber is gone.
    fn offer(&mut self, line: &str, lost_line: impl Fn(u64) -> String) -> bool {
        if self.lost > 0 {
            match self.tx.try_send(lost_line(self.lost)) {
                Ok(()) => self.lost = 0,
                Err(TrySendError::Full(_)) => {
                    self.lost += 1;
                    return true;
                }
                Err(TrySendError::Disconnected(_)) => return false,
            }
        }
        match self.tx.try_send(line.to_owned()) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.lost += 1;
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}

impl EventHub {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The VM's id and name from now on.
    pub fn set_identity(&self, id: Option<String>, name: Option<String>) {
        let mut inner = self.lock();
        inner.id = id;
        inner.name = name;
    }

    /// The VM's id and name, if known.
    pub fn identity(&self) -> (Option<String>, Option<String>) {
        let inner = self.lock();
        (inner.id.clone(), inner.name.clone())
    }

    /// Whether the hub closed (the VMM ends).
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// A new subscriber: the events from now on, until the hub closes (at
    /// once if it has).
    pub fn subscribe(&self) -> Receiver<String> {
        self.subscribe_with(QUEUE_LINES)
    }

    fn subscribe_with(&self, queue: usize) -> Receiver<String> {
        let (tx, rx) = sync_channel(queue);
        let mut inner = self.lock();
        if !inner.closed {
            inner.subscribers.push(Subscriber { tx, lost: 0 });
        }
        rx
    }

    /// Publishes event `kind` with `details` (a JSON object's fields; other
    /// values are ignored) to every subscriber, never waiting for one.
    pub fn publish(&self, kind: &str, details: Value) {
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        tracing::debug!(event = kind, "VM event");
        let line = line(&inner, kind, &details);
        let Inner {
            id,
            name,
            subscribers,
            ..
        } = &mut *inner;
        let lost_line = |n: u64| lost(id, name, n);
        subscribers.retain_mut(|s| s.offer(&line, lost_line));
    }

    /// Ends every subscriber's stream after what it holds (with the count
    /// of what it lost, if it can still take it); later events go nowhere.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        for mut s in std::mem::take(&mut inner.subscribers) {
            if s.lost > 0 {
                let _ = s.tx.try_send(lost(&inner.id, &inner.name, s.lost));
                s.lost = 0;
            }
        }
    }

    /// Appends every event to `file` (a file or a FIFO) from a thread of
    /// its own, which needs only `write`; it ends when the hub closes or
    /// the file fails (a FIFO's reader gone).
    pub fn write_to(&self, mut file: std::fs::File) -> std::io::Result<()> {
        let lines = self.subscribe();
        let (done, ended) = sync_channel(1);
        std::thread::Builder::new()
            .name("events-file".into())
            .spawn(move || {
                for line in lines {
                    let mut bytes = line.into_bytes();
                    bytes.push(b'\n');
                    if let Err(e) = file.write_all(&bytes) {
                        tracing::warn!(error = %e, "cannot write to the events file: no more events there");
                        break;
                    }
                }
                let _ = done.send(());
            })?;
        self.lock().writers.push(ended);
        Ok(())
    }

    /// Waits, up to `grace` in all, until the events file's writer has
    /// written what it holds (after [`close`](Self::close)).
    pub fn wait_writers(&self, grace: Duration) {
        let writers = std::mem::take(&mut self.lock().writers);
        let deadline = std::time::Instant::now() + grace;
        for w in writers {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if let Err(RecvTimeoutError::Timeout) = w.recv_timeout(left) {
                tracing::debug!("the events file's writer is still writing at the end");
            }
        }
    }
}

fn head(id: &Option<String>, name: &Option<String>, kind: &str) -> String {
    let text = |v: &Option<String>| match v {
        Some(s) => Value::from(s.as_str()).to_string(),
        None => "null".into(),
    };
    format!(
        "{{\"timestamp\":\"{}\",\"vm\":{},\"name\":{},\"event\":{}",
        rfc3339(SystemTime::now()),
        text(id),
        text(name),
        Value::from(kind)
    )
}

fn line(inner: &Inner, kind: &str, details: &Value) -> String {
    let mut line = head(&inner.id, &inner.name, kind);
    if let Value::Object(fields) = details {
        for (k, v) in fields {
            let _ = write!(line, ",{}:{}", Value::from(k.as_str()), v);
        }
    }
    line.push('}');
    line
}

fn lost(id: &Option<String>, name: &Option<String>, count: u64) -> String {
    format!("{},\"count\":{count}}}", head(id, name, "events_lost"))
}

/// `t` in RFC 3339, UTC, with microseconds: `2026-11-25T10:00:00.123456Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::UNIX_EPOCH;

    fn parse(line: &str) -> Value {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(1_764_064_800_123_456);
        assert_eq!(rfc3339(t), "2025-11-25T10:00:00.123456Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400 + 59);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:59.000000Z");
    }

    #[test]
    fn a_line_has_the_time_the_vm_the_kind_and_the_details() {
        let hub = EventHub::default();
        hub.set_identity(Some("0123456789abcdef".into()), None);
        let rx = hub.subscribe();
        hub.publish("paused", json!({ "by": "api" }));
        let v = parse(&rx.try_recv().unwrap());
        assert_eq!(v["vm"], "0123456789abcdef");
        assert_eq!(v["name"], Value::Null);
        assert_eq!(v["event"], "paused");
        assert_eq!(v["by"], "api");
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    }

    #[test]
    fn a_slow_subscriber_loses_events_and_is_told_how_many() {
        let hub = EventHub::default();
        let slow = hub.subscribe_with(2);
        let fast = hub.subscribe();
        for i in 0..10 {
            hub.publish("tick", json!({ "i": i }));
        }
        // The fast one has them all; publishing never waited for the slow one.
        assert_eq!(fast.try_iter().count(), 10);
        let first: Vec<Value> = slow.try_iter().map(|l| parse(&l)).collect();
        assert_eq!(
            first.iter().map(|v| v["i"].as_u64()).collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        // Room again: the loss first, then the event.
        hub.publish("tick", json!({ "i": 10 }));
        let next: Vec<Value> = slow.try_iter().map(|l| parse(&l)).collect();
        assert_eq!(next[0]["event"], "events_lost");
        assert_eq!(next[0]["count"], 8);
        assert_eq!(next[1]["i"], 10);
        // Lost again, and told in its last line when the hub closes.
        for i in 11..20 {
            hub.publish("tick", json!({ "i": i }));
        }
        drop(slow.try_recv());
        hub.close();
        let rest: Vec<Value> = slow.iter().map(|l| parse(&l)).collect();
        let last = rest.last().unwrap();
        assert_eq!(last["event"], "events_lost", "{rest:?}");
        assert!(last["count"].as_u64().unwrap() >= 7, "{last}");
        // The stream ended; a later subscriber's ends at once.
        assert!(hub.subscribe().recv().is_err());
        hub.publish("ignored", json!({}));
    }

    #[test]
    fn a_gone_subscriber_is_dropped_and_the_file_gets_every_line() {
        let hub = EventHub::default();
        drop(hub.subscribe());
        hub.publish("a", json!({}));
        assert!(hub.lock().subscribers.is_empty());
        let path = std::env::temp_dir().join(format!("kemari-events-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        hub.write_to(file).unwrap();
        hub.publish("b", json!({ "x": 1 }));
        hub.publish("c", json!({}));
        hub.close();
        hub.wait_writers(Duration::from_secs(10));
        let text = std::fs::read_to_string(&path).unwrap();
        let kinds: Vec<Value> = text.lines().map(|l| parse(l)["event"].clone()).collect();
        assert_eq!(kinds, [json!("b"), json!("c")]);
        std::fs::remove_file(path).unwrap();
    }
}
