//! CPU per byte of each end of an encrypted channel: the sender seals and
//! writes frames of page batches, the receiver reads and opens them, over a
//! Unix socket pair on this host. Prints each thread's CPU time (user +
//! system) per GiB. `cargo run --release -p transfer --example channel_cpu
//! [MiB] [plaintext|encrypted]`.

use std::os::unix::net::UnixStream;
use std::time::Instant;

use transfer::channel::{Auth, Channel};
use transfer::message::Kind;
use transfer::Peer;

const FRAME: usize = 256 * (9 + 4096);

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for the calling thread's CPU clock.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(1024, |s| s.parse().expect("MiB"));
    let plaintext = args.next().as_deref() == Some("plaintext");
    static KEY: [u8; 32] = [7u8; 32];
    let key = &KEY;
    let auth = if plaintext {
        Auth::PskPlaintext(key)
    } else {
        Auth::Psk(key)
    };
    let frames = mib * (1 << 20) / FRAME;
    let (a, b) = UnixStream::pair().expect("socketpair");
    let started = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut ch = Channel::connect(a, auth, Peer::Destination).expect("connect");
        let payload: Vec<u8> = (0..FRAME).map(|i| (i * 31) as u8).collect();
        let t0 = thread_cpu_ns();
        for _ in 0..frames {
            ch.send(Kind::Pages, &payload).expect("send");
        }
        thread_cpu_ns() - t0
    });
    let mut ch = Channel::accept(b, auth, Peer::Source).expect("accept");
    let mut buf = Vec::new();
    let t0 = thread_cpu_ns();
    for _ in 0..frames {
        ch.recv(&mut buf).expect("recv");
    }
    let recv_ns = thread_cpu_ns() - t0;
    let send_ns = sender.join().expect("sender");
    let gib = (frames * FRAME) as f64 / f64::from(1u32 << 30);
    println!(
        "{} {:.0} MiB in {:.2} s: send {:.3} s CPU/GiB, receive {:.3} s CPU/GiB",
        if plaintext { "tagged" } else { "encrypted" },
        gib * 1024.0,
        started.elapsed().as_secs_f64(),
        send_ns as f64 / 1e9 / gib,
        recv_ns as f64 / 1e9 / gib,
    );
}
