//! A TCP relay for tests: a long link (every chunk delivered a fixed delay
//! after it arrived, both ways), a link that can be cut, and a tap that
//! records what crosses it (to check that a guest page never crosses in
//! clear).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A relay on 127.0.0.1 to another local port.
pub struct Relay {
    /// Where it listens.
    pub port: u16,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    seen: Option<Arc<Mutex<Vec<u8>>>>,
}

impl Relay {
    /// Relays to `to`, every chunk `delay` after it arrived, both ways,
    /// recording what crosses ([`seen`](Self::seen)).
    pub fn start(to: u16, delay: Duration) -> Relay {
        Self::start_with(to, delay, true)
    }

    /// Like [`start`](Self::start), recording nothing (a long-running
    /// link: a benchmark's).
    pub fn delay_only(to: u16, delay: Duration) -> Relay {
        Self::start_with(to, delay, false)
    }

    fn start_with(to: u16, delay: Duration, record: bool) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let conns = Arc::new(Mutex::new(Vec::new()));
        let seen = record.then(|| Arc::new(Mutex::new(Vec::new())));
        let (kept, record) = (conns.clone(), seen.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    return;
                };
                for s in [&client, &server] {
                    kept.lock().unwrap().push(s.try_clone().unwrap());
                }
                pipe(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    delay,
                    record.clone(),
                );
                pipe(server, client, delay, record.clone());
            }
        });
        Relay { port, conns, seen }
    }

    /// Every byte that crossed it so far, both ways (none if it records
    /// nothing).
    pub fn seen(&self) -> Vec<u8> {
        self.seen
            .as_ref()
            .map(|s| s.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Whether `pattern` crossed it.
    pub fn saw(&self, pattern: &[u8]) -> bool {
        self.seen.as_ref().is_some_and(|s| {
            s.lock()
                .unwrap()
                .windows(pattern.len())
                .any(|w| w == pattern)
        })
    }

    /// Ends its connections.
    pub fn cut(&self) {
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
    }
}

type Line = (Mutex<(VecDeque<(Instant, Vec<u8>)>, bool)>, Condvar);

/// Copies `from` to `to`, each chunk `delay` after it was read, recording
/// it in `seen` if given.
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    seen: Option<Arc<Mutex<Vec<u8>>>>,
) {
    let line: Arc<Line> = Arc::new((Mutex::new((VecDeque::new(), false)), Condvar::new()));
    let writer = line.clone();
    std::thread::spawn(move || loop {
        let (due, chunk) = {
            let (lock, cv) = &*writer;
            let mut q = lock.lock().unwrap();
            loop {
                if let Some(c) = q.0.pop_front() {
                    break c;
                }
                if q.1 {
                    let _ = to.shutdown(Shutdown::Write);
                    return;
                }
                q = cv.wait(q).unwrap();
            }
        };
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if to.write_all(&chunk).is_err() {
            return;
        }
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = from.read(&mut buf).unwrap_or(0);
            let (lock, cv) = &*line;
            let mut q = lock.lock().unwrap();
            if n == 0 {
                q.1 = true;
                cv.notify_all();
                return;
            }
            if let Some(seen) = &seen {
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
            }
            q.0.push_back((Instant::now() + delay, buf[..n].to_vec()));
            cv.notify_all();
        }
    });
}
