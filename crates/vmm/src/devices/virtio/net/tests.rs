use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::*;
use crate::devices::virtio::block::tests::{guest_memory, CountingInterrupt, TestRing};
use crate::devices::virtio::tap::tests::test_tap;

/// Our test frames carry the "local experimental" EtherType.
const ETHERTYPE: u16 = 0x88b5;

/// An AF_PACKET socket bound to one interface: sees frames the TAP injects
/// (written by the device) and sends frames out through it (read by the device).
struct PacketSocket {
    fd: OwnedFd,
    ifindex: i32,
}

impl PacketSocket {
    fn bind(ifname: &str) -> PacketSocket {
        let proto = (ETHERTYPE).to_be();
        // SAFETY: socket() takes no pointers; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        };
        assert!(fd >= 0, "AF_PACKET socket: {}", io::Error::last_os_error());
        // SAFETY: fd was just returned by socket() and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let cname = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: if_nametoindex reads a valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) } as i32;
        assert!(ifindex > 0);
        // SAFETY: sockaddr_ll is plain data; all-zero is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex;
        // SAFETY: bind reads `sll` (valid, correctly sized) during the call.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", io::Error::last_os_error());
        PacketSocket { fd, ifindex }
    }

    fn send(&self, frame: &[u8]) {
        // SAFETY: sockaddr_ll is plain data; all-zero is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: sendto reads `frame` and `sll`, both valid for the call.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(
            n,
            frame.len() as isize,
            "sendto: {}",
            io::Error::last_os_error()
        );
    }

    /// Waits up to a second for one of our frames.
    fn recv(&self) -> Option<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut buf = vec![0u8; 2048];
        while Instant::now() < deadline {
            // SAFETY: recv writes at most buf.len() bytes into buf.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n > 0 {
                let n = n as usize;
                if n >= 14 && buf[12..14] == ETHERTYPE.to_be_bytes() {
                    return Some(buf[..n].to_vec());
                }
            } else {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        None
    }
}

fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const PEER: [u8; 6] = [0x02, 0, 0, 0, 0, 1];

struct Fixture {
    net: Net,
    rx: TestRing,
    tx: TestRing,
    irq: Arc<CountingInterrupt>,
    sock: PacketSocket,
}

fn fixture(tag: &str) -> Fixture {
    let tap = test_tap(tag);
    let sock = PacketSocket::bind(tap.name());
    let mem = guest_memory();
    let rx = TestRing::new(&mem, 0x10000, QUEUE_SIZE);
    let tx = TestRing::new(&mem, 0x20000, QUEUE_SIZE);
    let mut net = Net::new("net0", tap, MAC);
    let irq = Arc::new(CountingInterrupt::default());
    net.activate(Activation {
        mem,
        queues: vec![rx.queue(), tx.queue()],
        interrupt: irq.clone(),
        acked_features: net.features(),
    })
    .unwrap();
    Fixture {
        net,
        rx,
        tx,
        irq,
        sock,
    }
}

fn wait_rx(f: &mut Fixture, used: u16) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while f.rx.used_idx() != used && Instant::now() < deadline {
        f.net.backend_ready();
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[cfg_attr(no_tap, ignore = "needs TAP devices (root)")]
fn config_space_has_mac_and_link_up() {
    let f = fixture("c");
    let mut b = [0u8; 8];
    f.net.read_config(0, &mut b);
    assert_eq!(&b[..6], &MAC);
    assert_eq!(u16::from_le_bytes([b[6], b[7]]), LINK_UP);
    f.net.read_config(100, &mut b);
    assert_eq!(b, [0; 8]);
    assert_eq!(f.net.backend_fd(), Some(f.net.tap.as_raw_fd()));
}

#[test]
#[cfg_attr(no_tap, ignore = "needs TAP devices (root)")]
fn transmit_reaches_the_tap() {
    let mut f = fixture("t");
    let payload = b"kemari tx test frame, padded to a decent length....";
    let fr = frame(PEER, MAC, payload);
    let m = &f.tx.mem;
    // Header (12 bytes, with junk the device must clear) and frame in two descriptors.
    m.write_slice(&[0xff; VNET_HDR_LEN], GuestAddress(0x100000))
        .unwrap();
    m.write_slice(&fr, GuestAddress(0x101000)).unwrap();
    f.tx.add_chain(
        0,
        &[
            (0x100000, VNET_HDR_LEN as u32, false),
            (0x101000, fr.len() as u32, false),
        ],
    );
    assert_eq!(f.net.output_queue(), Some(TX_QUEUE));
    let batch = f.net.pending_outputs().expect("one frame waits");
    assert_eq!((batch.limit, batch.requests), (1, 1));
    assert_eq!(f.net.serve_outputs_until(batch.limit), 1);
    assert_eq!(f.net.pending_outputs(), None);
    assert_eq!(f.tx.used_idx(), 1);
    assert_eq!(f.tx.used_elem(0), (0, 0));
    let got = f.sock.recv().expect("frame seen on the interface");
    assert_eq!(got, fr);
    let c = f.net.counters();
    assert_eq!((c.requests, c.bytes_out), (1, fr.len() as u64));
    assert!(f.irq.used.load(std::sync::atomic::Ordering::SeqCst) >= 1);

    // A malformed chain (device-writable) is returned and counted, nothing sent.
    f.tx.add_chain(2, &[(0x101000, 64, true)]);
    // A chain too short for a header plus an Ethernet header.
    f.tx.add_chain(3, &[(0x101000, 20, false)]);
    // Out of memory.
    f.tx.add_chain(4, &[(0x100000, 12, false), (1 << 40, 100, false)]);
    f.net.queue_notified(TX_QUEUE);
    assert_eq!(f.tx.used_idx(), 4);
    assert_eq!(f.net.counters().bad_descriptors, 3);
    assert_eq!(f.net.counters().requests, 1);
}

#[test]
#[cfg_attr(no_tap, ignore = "needs TAP devices (root)")]
fn receive_fills_buffers_and_waits_when_none() {
    let mut f = fixture("r");
    let fr = frame(MAC, PEER, b"kemari rx test frame with some payload bytes");
    // No receive buffer yet: the frame stays pending, nothing is lost.
    f.sock.send(&fr);
    std::thread::sleep(Duration::from_millis(50));
    f.net.backend_ready();
    assert!(f.net.rx_pending());
    // The guest adds a buffer (header + frame in one descriptor) and notifies.
    f.rx.add_chain(0, &[(0x200000, 2048, true)]);
    f.net.queue_notified(RX_QUEUE);
    assert!(!f.net.rx_pending());
    assert_eq!(f.rx.used_idx(), 1);
    let (id, len) = f.rx.used_elem(0);
    assert_eq!((id, len as usize), (0, VNET_HDR_LEN + fr.len()));
    let mut got = vec![0u8; len as usize];
    f.rx.mem
        .read_slice(&mut got, GuestAddress(0x200000))
        .unwrap();
    let mut hdr = [0u8; VNET_HDR_LEN];
    hdr[10] = 1; // num_buffers = 1
    assert_eq!(&got[..VNET_HDR_LEN], &hdr);
    assert_eq!(&got[VNET_HDR_LEN..], &fr[..]);

    // A frame split over two buffers of one chain, delivered by backend_ready.
    f.rx.add_chain(1, &[(0x210000, 20, true), (0x211000, 2000, true)]);
    f.sock.send(&fr);
    wait_rx(&mut f, 2);
    assert_eq!(f.rx.used_elem(1).1 as usize, VNET_HDR_LEN + fr.len());
    let mut tail = vec![0u8; fr.len() - 8];
    f.rx.mem
        .read_slice(&mut tail, GuestAddress(0x211000))
        .unwrap();
    assert_eq!(&tail[..], &fr[8..]);

    // A buffer too small: the frame is dropped and counted, the buffer kept.
    f.rx.add_chain(3, &[(0x220000, 30, true)]);
    f.sock.send(&fr);
    let deadline = Instant::now() + Duration::from_secs(1);
    while f.net.counters().errors == 0 && Instant::now() < deadline {
        f.net.backend_ready();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(f.net.counters().errors, 1);
    assert_eq!(f.rx.used_idx(), 2);
    assert!(!f.net.rx_pending());
    let c = f.net.counters();
    assert_eq!((c.requests, c.bytes_in), (2, 2 * fr.len() as u64));
}

#[test]
#[cfg_attr(no_tap, ignore = "needs TAP devices (root)")]
fn transmit_and_dirty_tracking_of_receive() {
    let mut f = fixture("d");
    crate::memory::set_vmm_dirty_tracking(&f.rx.mem, true);
    let _ = crate::memory::harvest_vmm_dirty(&f.rx.mem);
    f.rx.add_chain(0, &[(0x300000, 2048, true)]);
    f.sock.send(&frame(MAC, PEER, b"dirty me"));
    wait_rx(&mut f, 1);
    let dirty = crate::memory::harvest_vmm_dirty(&f.rx.mem);
    assert!(dirty.contains(&(0x300000 >> 12)), "{dirty:x?}");
    assert!(dirty.contains(&(f.rx.used >> 12)), "{dirty:x?}");
    f.net.reset();
    assert!(!f.net.is_activated());
    // Not activated: frames are dropped and counted, the TAP left empty.
    let errors = f.net.counters().errors;
    f.sock.send(&frame(MAC, PEER, b"nobody home"));
    let deadline = Instant::now() + Duration::from_secs(1);
    while f.net.counters().errors == errors && Instant::now() < deadline {
        f.net.backend_ready();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(f.net.counters().errors, errors + 1);
    f.net.backend_ready();
    f.net.queue_notified(TX_QUEUE);
    assert!(f
        .tx
        .mem
        .read_obj::<u16>(GuestAddress(f.tx.used + 2))
        .is_ok());
}
