//! A TCP relay that holds every chunk for a fixed delay in each direction:
//! with `tc ... tbf` on a veth pair it emulates a WAN link on a kernel
//! without netem (used by bench/run.sh; a delay of 10 ms each way gives a
//! 20 ms RTT). Throughput is not limited here, only latency is added.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

/// Accepts on `listen` forever and relays each connection to `to`.
pub fn run(listen: &str, to: &str, delay: Duration) -> io::Result<()> {
    let l = TcpListener::bind(listen)?;
    for c in l.incoming() {
        let c = c?;
        let to = to.to_string();
        std::thread::spawn(move || {
            if let Ok(u) = TcpStream::connect(&to) {
                let _ = c.set_nodelay(true);
                let _ = u.set_nodelay(true);
                if let (Ok(c2), Ok(u2)) = (c.try_clone(), u.try_clone()) {
                    pipe(c, u2, delay);
                    pipe(u, c2, delay);
                }
            }
        });
    }
    Ok(())
}

/// Copies `from` to `to`, delivering each chunk `delay` after it arrived.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Read);
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
