//! The console: a 16550 UART at I/O port 0x3f8, transmit only.
//!
//! Every port access is a VM exit (~90 µs on kemari's KVM), so lines are
//! formatted into a buffer first and the line status register is not polled:
//! kemari's and QEMU's UARTs accept a byte whenever it is written.

use core::fmt::{self, Write};

use crate::cpu::outsb;

const COM1: u16 = 0x3f8;

/// Formats one line and writes it to the UART in one go.
pub struct LineWriter {
    buf: [u8; 256],
    len: usize,
}

impl LineWriter {
    pub const fn new() -> Self {
        Self {
            buf: [0; 256],
            len: 0,
        }
    }

    pub fn finish(&mut self) {
        if self.len == self.buf.len() {
            self.buf[self.len - 1] = b'\n';
        } else {
            self.buf[self.len] = b'\n';
            self.len += 1;
        }
        write_bytes(&self.buf[..self.len]);
        self.len = 0;
    }
}

impl Write for LineWriter {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &b in s.as_bytes() {
            if self.len < self.buf.len() {
                self.buf[self.len] = b;
                self.len += 1;
            }
        }
        Ok(())
    }
}

/// Writes raw bytes to the UART, as one string I/O instruction (kemari and
/// QEMU take `rep outsb` to the data register byte by byte).
pub fn write_bytes(bytes: &[u8]) {
    outsb(COM1, bytes);
}

/// Prints one line (a trailing newline is added), like `println!`.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        let mut line = $crate::serial::LineWriter::new();
        let _ = core::fmt::Write::write_fmt(&mut line, format_args!($($arg)*));
        line.finish();
    }};
}
