//! How big each echo connection's TCP buffers are: a share of the memory
//! free when the network comes up, as Linux scales its TCP memory with the
//! machine's. One connection's throughput is at most its window per round
//! trip, and fault tolerance lengthens the round trip (the guest's outputs
//! wait for their epoch to reach the standby): 128 KiB held a single
//! protected stream to a third of unprotected where 1 MiB gives it half
//! (docs/fault-tolerance.md). A small guest keeps small buffers.

/// Never less than this per buffer (what every guest had before).
pub const MIN: usize = 128 * 1024;
/// Never more than this per buffer.
pub const MAX: usize = 1024 * 1024;

/// Each receive and send buffer of an echo connection, given the guest's
/// free memory and the number of echo connections: together they take at
/// most an 8th of it, rounded down to a power of two within [`MIN`, `MAX`].
pub fn echo_buffer_bytes(free: u64, sockets: usize) -> usize {
    let share = free / 8 / (2 * sockets.max(1) as u64);
    let share = usize::try_from(share).unwrap_or(usize::MAX).clamp(MIN, MAX);
    // A power of two: `share` is at least MIN, so never 0.
    1 << (usize::BITS - 1 - share.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_grow_with_memory_between_the_bounds() {
        const MIB: u64 = 1 << 20;
        // 8 connections, 2 buffers each.
        assert_eq!(echo_buffer_bytes(20 * MIB, 8), MIN);
        assert_eq!(echo_buffer_bytes(60 * MIB, 8), 256 * 1024);
        assert_eq!(echo_buffer_bytes(120 * MIB, 8), 512 * 1024);
        assert_eq!(echo_buffer_bytes(250 * MIB, 8), MAX);
        assert_eq!(echo_buffer_bytes(64 * 1024 * MIB, 8), MAX);
        assert_eq!(echo_buffer_bytes(0, 0), MIN);
        // Never more than an 8th of what is free, once above the minimum.
        for free in [40 * MIB, 70 * MIB, 300 * MIB, 1000 * MIB] {
            let b = echo_buffer_bytes(free, 8);
            assert!(b as u64 * 2 * 8 <= free / 8, "{free}: {b}");
            assert!(b.is_power_of_two());
        }
    }
}
