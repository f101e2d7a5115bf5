//! Telling the process's owner that a destination listens: the receiving
//! end of a hand-over (live or zero-copy migration, a warm-restart
//! successor, a fault-tolerance standby) waits on a socket, and whoever
//! supervises the process (kemari: systemd's `READY=1`) may want to know
//! the moment that socket accepts connections.

use std::sync::OnceLock;

type Hook = Box<dyn Fn(&str) + Send + Sync>;

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Calls `hook` with the address (`HOST:PORT` or a socket's path) each time
/// a destination of this process starts listening, on the thread that
/// listens. Set once per process; a second call is ignored.
pub fn on_listening(hook: impl Fn(&str) + Send + Sync + 'static) {
    let _ = HOOK.set(Box::new(hook));
}

/// A destination listens on `addr`.
pub(crate) fn listening(addr: &str) {
    if let Some(hook) = HOOK.get() {
        hook(addr);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_destination_says_where_it_listens_before_it_accepts() {
        static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
        on_listening(|addr| SEEN.lock().unwrap().push(addr.to_owned()));
        // Port 0: the hook gets the port the kernel chose, not the one asked.
        let waiting = std::thread::spawn(|| {
            let listener = crate::net::listen("127.0.0.1:0").unwrap();
            listener.accept().map(|_| ())
        });
        let started = Instant::now();
        let addr = loop {
            if let Some(a) = SEEN.lock().unwrap().last().cloned() {
                break a;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "no hook call");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(
            addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"),
            "{addr}"
        );
        let _client = std::net::TcpStream::connect(&addr).expect("it listens already");
        assert!(waiting.join().unwrap().is_ok());
    }
}
