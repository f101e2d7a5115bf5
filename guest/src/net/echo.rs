//! TCP and UDP echo (RFC 862) on port 7.

use alloc::vec::Vec;

use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};

use super::ECHO_PORT;

pub struct Echo {
    tcp: Vec<SocketHandle>,
    udp: SocketHandle,
    scratch: Vec<u8>,
}

impl Echo {
    pub fn new(tcp: Vec<SocketHandle>, udp: SocketHandle) -> Self {
        Self {
            tcp,
            udp,
            scratch: alloc::vec![0u8; 65536],
        }
    }

    /// Returns true when it queued data to send.
    pub fn poll(&mut self, sockets: &mut SocketSet<'_>) -> bool {
        let mut sent = false;
        for &h in &self.tcp {
            let s = sockets.get_mut::<tcp::Socket>(h);
            if !s.is_open() {
                let _ = s.listen(ECHO_PORT);
                continue;
            }
            // Echo only what fits in the send buffer: nothing is dropped,
            // the rest waits in the receive buffer (back-pressure).
            let room = s.send_capacity() - s.send_queue();
            if s.can_recv() && room > 0 {
                let want = room.min(self.scratch.len());
                if let Ok(n) = s.recv_slice(&mut self.scratch[..want]) {
                    if n > 0 {
                        let _ = s.send_slice(&self.scratch[..n]);
                        sent = true;
                    }
                }
            }
            // The peer finished and everything was echoed: finish too.
            if !s.may_recv() && s.recv_queue() == 0 && s.send_queue() == 0 && s.may_send() {
                s.close();
            }
        }

        let s = sockets.get_mut::<udp::Socket>(self.udp);
        if !s.is_open() {
            let _ = s.bind(ECHO_PORT);
        }
        while s.can_recv() && s.can_send() {
            match s.recv_slice(&mut self.scratch) {
                Ok((n, meta)) => {
                    let _ = s.send_slice(&self.scratch[..n], meta.endpoint);
                    sent = true;
                }
                Err(_) => break,
            }
        }
        sent
    }
}
