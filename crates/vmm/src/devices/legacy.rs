//! Legacy port-I/O devices: the 16550 UART (COM1), the i8042 controller (only
//! its CPU-reset command), and the exit port 0xf4 (compatible with QEMU's
//! isa-debug-exit) through which a guest powers the VM off with a status code.

use std::io;
use std::sync::Arc;

use vm_superio::serial::NoEvents;
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::BusDevice;
use super::console_buffer::ConsoleBuffer;
use super::serial_output::SerialOutput;
use crate::output::OutputGate;
use crate::vstate::{VmEvent, VmEventSink};

/// COM1 base port.
pub const SERIAL_PORT: u64 = 0x3f8;
/// COM1 interrupt line.
pub const SERIAL_GSI: u32 = 4;
/// i8042 data port (the device spans 0x60..=0x64).
pub const I8042_PORT: u64 = 0x60;
/// The exit port.
pub const EXIT_PORT: u64 = 0xf4;

/// Raises an interrupt by writing an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Reports a [`VmEvent`] to the machine.
pub struct EventTrigger {
    events: VmEventSink,
    event: VmEvent,
}

impl Trigger for EventTrigger {
    type E = ();
    fn trigger(&self) -> Result<(), ()> {
        self.events.send(self.event.clone());
        Ok(())
    }
}

/// COM1.
pub struct SerialDevice {
    serial: Serial<IrqTrigger, NoEvents, ConsoleBuffer>,
    bytes_out: u64,
}

impl SerialDevice {
    /// A UART raising `irq` and writing to `out` when `gate` lets the
    /// console write.
    pub fn new(irq: EventFd, out: SerialOutput, gate: Arc<dyn OutputGate>) -> Self {
        SerialDevice {
            serial: Serial::new(IrqTrigger(irq), ConsoleBuffer::new(out, gate)),
            bytes_out: 0,
        }
    }

    /// A UART continuing from saved register state.
    pub fn from_state(
        irq: EventFd,
        out: SerialOutput,
        state: &vm_superio::serial::SerialState,
        gate: Arc<dyn OutputGate>,
    ) -> Result<Self, String> {
        let serial = Serial::from_state(
            state,
            IrqTrigger(irq),
            NoEvents,
            ConsoleBuffer::new(out, gate),
        )
        .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(SerialDevice {
            serial,
            bytes_out: 0,
        })
    }

    /// Writes out the console bytes still buffered (see
    /// [`ConsoleBuffer`]): before the VM pauses for a save, so that nothing
    /// the guest printed stays behind in a VMM that is about to end.
    pub fn flush_output(&mut self) {
        self.serial.writer_mut().flush_pending();
    }

    /// Writes out what the console holds and hands its output over, for
    /// the UART of the machine's next boot (a reboot); this one writes
    /// nowhere afterwards.
    pub fn take_output(&mut self) -> SerialOutput {
        self.serial.writer_mut().take_output()
    }

    /// Starts the console's flusher thread if it has not started.
    pub fn start_output_flusher(&mut self) {
        self.serial.writer_mut().start_flusher_now();
    }

    /// Console bytes still buffered (not yet written out, or held).
    pub fn pending_output(&mut self) -> usize {
        self.serial.writer_mut().pending_len()
    }

    /// Bytes the guest has written.
    pub fn bytes_out(&self) -> u64 {
        self.bytes_out
    }

    /// UART register state (for snapshots).
    pub fn state(&self) -> vm_superio::serial::SerialState {
        self.serial.state()
    }
}

impl BusDevice for SerialDevice {
    // A string instruction (`rep insb`/`rep outsb`) arrives as one access of
    // several bytes: each byte is one register access.
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let Ok(off) = u8::try_from(offset) else {
            return;
        };
        for b in data.iter_mut() {
            *b = self.serial.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(off) = u8::try_from(offset) else {
            return;
        };
        for &b in data {
            if off == 0 {
                self.bytes_out += 1;
            }
            if let Err(e) = self.serial.write(off, b) {
                tracing::debug!(error = ?e, "serial write failed");
            }
        }
    }
}

/// The i8042 controller; its CPU-reset command resets the VM.
pub struct I8042 {
    dev: I8042Device<EventTrigger>,
}

impl I8042 {
    /// An i8042 that reports [`VmEvent::Reset`] on `events`.
    pub fn new(events: VmEventSink) -> Self {
        I8042 {
            dev: I8042Device::new(EventTrigger {
                events,
                event: VmEvent::Reset,
            }),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(off), Some(b)) = (u8::try_from(offset), data.first_mut()) {
            *b = self.dev.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), Some(&b)) = (u8::try_from(offset), data.first()) {
            let _ = self.dev.write(off, b);
        }
    }
}

/// Port 0xf4: a write of value `v` powers the VM off with guest status `v`.
pub struct ExitPort {
    events: VmEventSink,
}

impl ExitPort {
    /// An exit port reporting on `events`.
    pub fn new(events: VmEventSink) -> Self {
        ExitPort { events }
    }
}

impl BusDevice for ExitPort {
    fn read(&mut self, _offset: u64, _data: &mut [u8]) {}

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 || data.is_empty() || data.len() > 4 {
            return;
        }
        let mut v = [0u8; 4];
        v[..data.len()].copy_from_slice(data);
        self.events.send(VmEvent::Poweroff {
            code: u32::from_le_bytes(v),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::serial_output::SerialSocket;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc::channel;

    #[test]
    fn exit_port_reports_code() {
        let (tx, rx) = channel();
        let mut p = ExitPort::new(VmEventSink::channel(tx));
        p.write(0, &[3, 0, 0, 0]);
        p.write(1, &[9]);
        p.write(0, &[0]);
        assert_eq!(rx.try_recv().unwrap(), VmEvent::Poweroff { code: 3 });
        assert_eq!(rx.try_recv().unwrap(), VmEvent::Poweroff { code: 0 });
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn i8042_reset_command() {
        let (tx, rx) = channel();
        let mut d = I8042::new(VmEventSink::channel(tx));
        d.write(0, &[0xfe]);
        assert!(rx.try_recv().is_err());
        d.write(4, &[0xfe]);
        assert_eq!(rx.try_recv().unwrap(), VmEvent::Reset);
    }

    #[test]
    fn serial_writes_to_socket_backlog_then_client() {
        let path = std::env::temp_dir().join(format!("kemari-serial-{}", std::process::id()));
        let sock = SerialSocket::bind(&path).unwrap();
        let mut dev = SerialDevice::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            SerialOutput::Socket(sock),
            Arc::new(crate::output::PassThroughGate),
        );
        dev.write(0, b"h");
        dev.write(0, b"i\n"); // a string instruction
        let mut client = UnixStream::connect(&path).unwrap();
        let mut buf = [0u8; 3];
        io::Read::read_exact(&mut client, &mut buf).unwrap();
        assert_eq!(&buf, b"hi\n");
        assert_eq!(dev.bytes_out(), 3);
        std::fs::remove_file(path).unwrap();
    }
}
