//! The client allow-list of TCP listeners (`--allow ADDR[/PREFIX]`,
//! repeatable): a connection from any other address is logged and closed
//! before the server sends a byte. Empty: everyone is served.
//!
//! An IPv4 client reaching an IPv6 listener appears as `::ffff:a.b.c.d`; it
//! matches the IPv4 entries as `a.b.c.d`.

use std::net::IpAddr;

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid --allow {input:?}: {why} (expected ADDR or ADDR/PREFIX, e.g. 192.0.2.0/24, 10.1.2.3 or 2001:db8::/32)")]
pub struct AllowError {
    pub input: String,
    pub why: &'static str,
}

/// One `ADDR/PREFIX` network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    pub fn parse(input: &str) -> Result<Network, AllowError> {
        let bad = |why| AllowError {
            input: input.to_string(),
            why,
        };
        let (addr, prefix) = match input.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (input, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad("not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                bad("the prefix must be a number of bits (0-32 for IPv4, 0-128 for IPv6)")
            })?,
        };
        Ok(Network { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                same_prefix(u32::from(net).into(), u32::from(ip).into(), 32, self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                same_prefix(u128::from(net), u128::from(ip), 128, self.prefix)
            }
            _ => false,
        }
    }
}

/// Whether the first `prefix` of `bits` bits of `a` and `b` are equal.
fn same_prefix(a: u128, b: u128, bits: u32, prefix: u8) -> bool {
    let prefix = u32::from(prefix);
    if prefix == 0 {
        return true;
    }
    let shift = bits - prefix;
    (a >> shift) == (b >> shift)
}

/// The networks whose clients are served.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    networks: Vec<Network>,
}

impl AllowList {
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<AllowList, AllowError> {
        let networks = entries
            .iter()
            .map(|e| Network::parse(e.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(AllowList { networks })
    }

    pub fn is_empty(&self) -> bool {
        self.networks.is_empty()
    }

    /// Whether a client at `ip` is served.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.networks.is_empty() || self.networks.iter().any(|n| n.contains(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_match_their_prefix() {
        let l = AllowList::parse(&["192.0.2.0/24", "10.1.2.3", "2001:db8::/32"]).unwrap();
        assert!(l.allows(ip("192.0.2.77")));
        assert!(!l.allows(ip("192.0.3.1")));
        assert!(l.allows(ip("10.1.2.3")));
        assert!(!l.allows(ip("10.1.2.4")));
        assert!(l.allows(ip("2001:db8:1::5")));
        assert!(!l.allows(ip("2001:db9::1")));
        // IPv4 clients of an IPv6 listener.
        assert!(l.allows(ip("::ffff:192.0.2.9")));
        assert!(!l.allows(ip("127.0.0.1")));
        assert!(AllowList::default().allows(ip("127.0.0.1")));
        assert!(AllowList::parse(&["0.0.0.0/0"])
            .unwrap()
            .allows(ip("203.0.113.1")));
        assert!(AllowList::parse(&["::/0"]).unwrap().allows(ip("::1")));
    }

    #[test]
    fn bad_entries_are_named() {
        for bad in [
            "localhost",
            "10.0.0.0/33",
            "::1/129",
            "10.0.0.0/",
            "10.0.0.0/x",
        ] {
            let e = AllowList::parse(&[bad]).unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }
}
