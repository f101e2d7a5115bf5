//! What this host charges every fault-tolerance sync, whatever the VMM does:
//! measured beside `kemari-bench ft`'s figures so that its request/response
//! ratio can be read against the best any event-driven synchronizer could do
//! here.
//!
//! An output may leave only once the standby holds a state taken after the
//! guest asked for it. So every protected request/response exchange pays, on
//! top of the unprotected exchange, at least
//! - the save of the vCPU that produced the output ([`vcpu_stop_and_save`]:
//!   kemari's own `save_with`, run as the primary runs it, on the vCPU's
//!   thread right after the pause's exit — the cheapest moment, with
//!   registers from `kvm_run`), and
//! - one round trip to the standby process ([`loopback_round_trip`]: 64 bytes
//!   out, 16 back, between two threads over loopback TCP), measured twice:
//!   with both ends sleeping in `read` until data comes (what a synchronizer
//!   sharing its cores with the guest must do), and with both ends polling
//!   (no wake-up, but a core burned on each side).
//!
//! Everything else a sync does (stopping the vCPU, harvesting and copying
//! pages, encoding, authenticating, the standby's checks) comes on top; the
//! ceiling [`Floor::ceiling`] leaves it out, so it is an upper bound.
//!
//! Of those, stopping the vCPU is the host's too: its registers can only be
//! read from its own thread once `KVM_RUN` has returned, so every sync takes
//! the guest out to user space at least once (a kick, or an exit the output
//! itself caused). [`vcpu_stop_and_save`] times that stop as well — from the
//! pause's request to the moment the save can begin on the vCPU's thread —
//! and [`Floor::ceiling_with_stop`] counts it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::devices::bus::Bus;
use vmm::dirty::page_writer::PageWriter;
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::persist::vcpu::{read_constants, save_with};
use vmm::vstate::vcpu::{PauseLength, Vcpu, VcpuSet};
use vmm::vstate::vm::Vm;
use vmm::vstate::VmEventSink;

/// The host's per-sync minimums, medians.
#[derive(Debug, Clone, Copy)]
pub struct Floor {
    /// Stopping a running vCPU: its kick until its thread is out of
    /// `KVM_RUN` and can save it.
    pub vcpu_stop: Duration,
    /// One vCPU state save after a guest exit.
    pub vcpu_save: Duration,
    /// One loopback round trip between two threads sleeping in `read`.
    pub round_trip_sleeping: Duration,
    /// The same with both threads polling their sockets.
    pub round_trip_polling: Duration,
}

impl Floor {
    /// Measures all four.
    pub fn measure() -> Result<Floor, String> {
        let (vcpu_stop, vcpu_save) = vcpu_stop_and_save(200)?;
        Ok(Floor {
            vcpu_stop,
            vcpu_save,
            round_trip_sleeping: loopback_round_trip(2000, false)?,
            round_trip_polling: loopback_round_trip(5000, true)?,
        })
    }

    /// The highest protected ÷ unprotected request/response ratio possible
    /// here when an unprotected exchange takes `unprotected` and a round
    /// trip to the standby takes `round_trip`: every protected exchange
    /// takes at least `unprotected + vcpu_save + round_trip`.
    pub fn ceiling(&self, unprotected: Duration, round_trip: Duration) -> f64 {
        let t = unprotected.as_secs_f64();
        t / (t + self.vcpu_save.as_secs_f64() + round_trip.as_secs_f64())
    }

    /// The same with the vCPU's stop counted too: every protected exchange
    /// takes at least `unprotected + vcpu_stop + vcpu_save + round_trip`.
    pub fn ceiling_with_stop(&self, unprotected: Duration, round_trip: Duration) -> f64 {
        let t = unprotected.as_secs_f64();
        t / (t + (self.vcpu_stop + self.vcpu_save + round_trip).as_secs_f64())
    }
}

fn ctx<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
    move |e| format!("{what}: {e}")
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// The median time of kemari's vCPU save (`persist::vcpu::save_with`) as the
/// fault-tolerance primary does it at every sync: the vCPU runs a guest on
/// its own thread, `VcpuSet::pause_with` kicks it out of KVM_RUN and runs the
/// save on that thread right after the exit (registers from `kvm_run`).
/// Returns the medians over `rounds` pauses of the stop (the pause's request
/// until the save begins on the vCPU's thread) and of the save.
pub fn vcpu_stop_and_save(rounds: usize) -> Result<(Duration, Duration), String> {
    let file =
        GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).map_err(ctx("guest memory"))?;
    let mem = file.map().map_err(ctx("guest memory"))?;
    let vm = Vm::new().map_err(ctx("KVM VM"))?;
    vm.register_memory(&mem).map_err(ctx("memory slots"))?;
    let mut vcpu = Vcpu::new(vm.fd(), 0).map_err(ctx("vCPU"))?;
    // A guest that keeps writing a page (its `out` goes to an empty bus).
    let writer = PageWriter::new(16, 1, 0x510).map_err(ctx("guest program"))?;
    writer
        .install(&mem, &mut vcpu)
        .map_err(ctx("guest program"))?;
    let msrs: Arc<Vec<u32>> =
        Arc::new(vmm::persist::vcpu::msr_indices(vm.kvm()).map_err(ctx("KVM_GET_MSR_INDEX_LIST"))?);
    let constants = Arc::new(read_constants(vcpu.fd(), 0).map_err(ctx("vCPU constants"))?);
    let handle = vcpu
        .start(
            Arc::new(Bus::new()),
            Arc::new(Bus::new()),
            VmEventSink::new(|_| {}),
            false,
        )
        .map_err(ctx("vCPU thread"))?;
    let vcpus = VcpuSet::new(vec![handle], false);
    let (mut stops, mut saves) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for i in 0..rounds + 10 {
        // Let the guest run between pauses, as between syncs.
        std::thread::sleep(Duration::from_micros(200));
        let (msrs, constants) = (msrs.clone(), constants.clone());
        let asked = Instant::now();
        let saved = vcpus.pause_with(PauseLength::Brief, move |index, fd| {
            let t = Instant::now();
            let r = save_with(fd, index, &msrs, &constants);
            (
                t - asked,
                t.elapsed(),
                r.map(|_| ()).map_err(|e| e.to_string()),
            )
        });
        vcpus.resume().map_err(ctx("vCPU resume"))?;
        for (stop, save, r) in saved.map_err(ctx("vCPU pause"))? {
            r.map_err(ctx("vCPU save"))?;
            if i >= 10 {
                stops.push(stop);
                saves.push(save);
            }
        }
    }
    Ok((median(stops), median(saves)))
}

/// The median round trip of a 64-byte message answered by 16 bytes between
/// two threads over loopback TCP (no Nagle), over `iters` exchanges. With
/// `polling`, both ends poll their non-blocking sockets instead of sleeping
/// in `read`: the fastest exchange this host's TCP allows, with no thread
/// wake-up in it.
pub fn loopback_round_trip(iters: usize, polling: bool) -> Result<Duration, String> {
    let io = |e: std::io::Error| format!("loopback: {e}");
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_nonblocking(polling)?;
        let mut req = [0u8; 64];
        loop {
            if !read_polling(&mut s, &mut req)? {
                return Ok(());
            }
            s.write_all(&req[..16])?;
        }
    });
    let mut s = TcpStream::connect(addr).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    s.set_nonblocking(polling).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(io)?;
    let req = [0x5au8; 64];
    let mut ack = [0u8; 16];
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 100 {
        let t = Instant::now();
        s.write_all(&req).map_err(io)?;
        if !read_polling(&mut s, &mut ack).map_err(io)? {
            return Err("loopback: the echo thread hung up".into());
        }
        if i >= 100 {
            times.push(t.elapsed());
        }
    }
    drop(s);
    echo.join()
        .map_err(|_| "loopback: the echo thread panicked".to_owned())?
        .map_err(io)?;
    Ok(median(times))
}

/// Fills `buf` from `s` (polling if it is non-blocking); `false` at end of
/// stream before the first byte. Gives up after 5 s without progress.
fn read_polling(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    let mut since = Instant::now();
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                since = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if since.elapsed() > Duration::from_secs(5) {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                std::hint::spin_loop();
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_adds_the_floor_to_every_exchange() {
        let f = Floor {
            vcpu_stop: Duration::from_micros(60),
            vcpu_save: Duration::from_micros(40),
            round_trip_sleeping: Duration::from_micros(20),
            round_trip_polling: Duration::from_micros(5),
        };
        let us = Duration::from_micros;
        // 30 µs unprotected: at best 30 / (30 + 40 + 20).
        assert!((f.ceiling(us(30), f.round_trip_sleeping) - 1.0 / 3.0).abs() < 1e-9);
        // A slower unprotected exchange, or a faster link, leaves more room.
        assert!(f.ceiling(us(120), f.round_trip_sleeping) > 0.6);
        assert!((f.ceiling(us(30), f.round_trip_polling) - 0.4).abs() < 1e-9);
        // Counting the stop: 30 / (30 + 60 + 40 + 5).
        assert!((f.ceiling_with_stop(us(30), f.round_trip_polling) - 30.0 / 135.0).abs() < 1e-9);
    }

    #[test]
    #[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
    fn vcpu_stop_and_save_are_measured_through_a_pause() {
        let (stop, save) = vcpu_stop_and_save(5).unwrap();
        assert!(stop > Duration::ZERO && save > Duration::ZERO);
    }

    #[test]
    fn loopback_round_trip_is_measured_both_ways() {
        for polling in [false, true] {
            let rtt = loopback_round_trip(50, polling).unwrap();
            assert!(rtt > Duration::ZERO);
        }
    }
}
