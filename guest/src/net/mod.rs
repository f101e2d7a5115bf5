//! The TCP/IP stack (smoltcp) on virtio-net, with a static address from the
//! command line, and the services: TCP echo (port 7), UDP echo (port 7) and
//! a small HTTP server (port 80, which also reboots the guest on `GET
//! /reboot`). ICMP echo (ping) is answered by smoltcp.

mod echo;
mod http;

use alloc::vec;
use alloc::vec::Vec;

use guest::cmdline::Ipv4Cidr;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, Ipv4Address};

use crate::say;
use crate::virtio::net::VirtioNet;

pub const ECHO_PORT: u16 = 7;
pub const HTTP_PORT: u16 = 80;
/// Concurrent connections per TCP service.
const TCP_ECHO_SOCKETS: usize = 8;
const HTTP_SOCKETS: usize = 8;

pub struct NetStack {
    dev: VirtioNet,
    iface: Interface,
    sockets: SocketSet<'static>,
    echo: echo::Echo,
    http: http::Http,
}

fn tcp_socket(buffer: usize) -> tcp::Socket<'static> {
    let mut s = tcp::Socket::new(
        tcp::SocketBuffer::new(vec![0u8; buffer]),
        tcp::SocketBuffer::new(vec![0u8; buffer]),
    );
    s.set_nagle_enabled(false);
    s
}

impl NetStack {
    pub fn new(mut dev: VirtioNet, ip: Ipv4Cidr, gw: Option<[u8; 4]>, now_us: u64) -> Self {
        let mac = dev.mac();
        let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(mac)));
        config.random_seed = crate::cpu::rdtsc();
        let now = Instant::from_micros(now_us as i64);
        let mut iface = Interface::new(config, &mut dev, now);
        let [a, b, c, d] = ip.addr;
        iface.update_ip_addrs(|addrs| {
            let _ = addrs.push(IpCidr::new(IpAddress::v4(a, b, c, d), ip.prefix));
        });
        if let Some([a, b, c, d]) = gw {
            let _ = iface
                .routes_mut()
                .add_default_ipv4_route(Ipv4Address::new(a, b, c, d));
        }
        let mut sockets = SocketSet::new(Vec::new());
        let buffer = guest::tcpbuf::echo_buffer_bytes(crate::mem::free_bytes(), TCP_ECHO_SOCKETS);
        let tcp_echo = (0..TCP_ECHO_SOCKETS)
            .map(|_| sockets.add(tcp_socket(buffer)))
            .collect();
        let udp_echo = sockets.add(udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0u8; 65536]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0u8; 65536]),
        ));
        let http_socks: Vec<SocketHandle> = (0..HTTP_SOCKETS)
            .map(|_| sockets.add(tcp_socket(16 * 1024)))
            .collect();
        say!(
            "net: up ip={}.{}.{}.{}/{} mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            a,
            b,
            c,
            d,
            ip.prefix,
            mac[0],
            mac[1],
            mac[2],
            mac[3],
            mac[4],
            mac[5]
        );
        Self {
            dev,
            iface,
            sockets,
            echo: echo::Echo::new(tcp_echo, udp_echo),
            http: http::Http::new(http_socks),
        }
    }

    /// A `/reboot` was answered: time to reset.
    pub fn reboot_due(&self, now_ms: u64) -> bool {
        self.http.reboot_due(&self.sockets, now_ms)
    }

    /// Moves packets and runs the services; never blocks.
    pub fn poll(&mut self, now_us: u64) {
        let now = Instant::from_micros(now_us as i64);
        self.iface.poll(now, &mut self.dev, &mut self.sockets);
        let mut again = self.echo.poll(&mut self.sockets);
        again |= self.http.poll(&mut self.sockets, now_us / 1000);
        if again {
            // The services queued data: send it now rather than next round.
            self.iface.poll(now, &mut self.dev, &mut self.sockets);
        }
        self.dev.flush();
    }
}
