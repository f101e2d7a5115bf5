//! Device models: the address buses, legacy ports (serial, i8042, exit port)
//! and the console's output, disk backends and virtio devices.

pub mod block_backend;
pub mod bus;
pub mod cached_backend;
pub mod console_buffer;
pub mod disk_cache;
pub mod event_loop;
pub mod legacy;
pub mod nbd_backend;
pub mod serial_output;
pub mod virtio;

use serde::{Deserialize, Serialize};

use virtio::DeviceCounters;

/// A device as the API lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Name ("block0", "net0", "serial0").
    pub name: String,
    /// Kind ("virtio-blk", "virtio-net", "serial").
    pub kind: String,
    /// MMIO window or port base; in JSON a hex string ("0xd0000000"), as
    /// addresses are read everywhere else (an integer is accepted too).
    #[serde(with = "hex_address")]
    pub address: u64,
    /// Interrupt line.
    pub gsi: u32,
    /// Backend (image path, TAP name, console target).
    pub backend: String,
    /// Request counters.
    pub counters: DeviceCounters,
    /// A virtio device's queues while its driver runs it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queues: Vec<crate::devices::virtio::QueueView>,
    /// A virtio device's InterruptStatus register (non-zero: an interrupt
    /// the guest has not acknowledged yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupt_status: Option<u32>,
}

/// A device address as a `0x` hex string in JSON.
mod hex_address {
    use serde::{de, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(address: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{address:#x}"))
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Address {
        Text(String),
        Number(u64),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match Address::deserialize(d)? {
            Address::Number(n) => Ok(n),
            Address::Text(t) => {
                let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X"));
                match digits {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => t.parse(),
                }
                .map_err(|_| {
                    de::Error::custom(format!("{t:?} is not an address (e.g. 0xd0000000)"))
                })
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use crate::devices::{DeviceCounters, DeviceInfo};

        fn info(address: u64) -> DeviceInfo {
            DeviceInfo {
                name: "block0".into(),
                kind: "virtio-blk".into(),
                address,
                gsi: 5,
                backend: "disk.img".into(),
                counters: DeviceCounters::default(),
                queues: Vec::new(),
                interrupt_status: None,
            }
        }

        #[test]
        fn addresses_are_hex_in_json_and_read_back() {
            let json = serde_json::to_value(info(0xd000_0000)).unwrap();
            assert_eq!(json["address"], "0xd0000000");
            let back: DeviceInfo = serde_json::from_value(json).unwrap();
            assert_eq!(back, info(0xd000_0000));
        }

        #[test]
        fn a_decimal_address_is_still_read_and_a_bad_one_is_named() {
            let mut json = serde_json::to_value(info(0)).unwrap();
            json["address"] = serde_json::json!(1016);
            assert_eq!(
                serde_json::from_value::<DeviceInfo>(json.clone())
                    .unwrap()
                    .address,
                1016
            );
            json["address"] = serde_json::json!("0xzz");
            let e = serde_json::from_value::<DeviceInfo>(json)
                .unwrap_err()
                .to_string();
            assert!(e.contains("\"0xzz\" is not an address"), "{e}");
        }
    }
}
