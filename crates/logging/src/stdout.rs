//! A command's output on stdout, ending quietly when nobody reads it.
//!
//! Rust ignores SIGPIPE, so writing to a closed pipe fails with EPIPE and
//! `println!` panics ("failed printing to stdout: Broken pipe", exit 101).
//! Here that error ends the process as a coreutils command ends: killed by
//! SIGPIPE, nothing on stderr. Servers keep SIGPIPE ignored (a client that
//! goes away is an error on its connection, never the process's end) and
//! never print through this.

use std::io::{self, BufWriter, Write};

/// Runs `print` on a buffered, locked stdout and flushes it. If stdout is a
/// closed pipe, the process dies of SIGPIPE; other errors are returned.
pub fn write(print: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let result = print(&mut out).and_then(|()| out.flush());
    match result {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => die_of_sigpipe(),
        other => other,
    }
}

/// [`write`] of one line.
pub fn line(text: &str) -> io::Result<()> {
    write(|w| writeln!(w, "{text}"))
}

fn die_of_sigpipe() -> ! {
    // SAFETY: restoring SIGPIPE's default action and raising it only changes
    // signal dispositions; no memory is involved. The default action ends
    // the process here.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Not reached; in case the signal is blocked, the shell's status for it.
    std::process::exit(128 + libc::SIGPIPE)
}
