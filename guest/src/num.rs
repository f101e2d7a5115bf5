//! Number parsing shared by the command-line parser.

/// Parses an unsigned integer: decimal, or hexadecimal with a `0x` prefix.
pub fn parse_u64(s: &str) -> Option<u64> {
    let (digits, radix) = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => (hex, 16),
        None => (s, 10),
    };
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// Parses a size like Linux's `memparse`: a number with an optional
/// K, M or G suffix (binary multiples).
pub fn parse_size(s: &str) -> Option<u64> {
    let (num, shift) = match s.as_bytes().last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 10),
        b'm' | b'M' => (&s[..s.len() - 1], 20),
        b'g' | b'G' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    parse_u64(num)?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(parse_u64("42"), Some(42));
        assert_eq!(parse_u64("0xd0000000"), Some(0xd000_0000));
        assert_eq!(parse_u64(""), None);
        assert_eq!(parse_u64("0x"), None);
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_u64("12a"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("0x200"), Some(512));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size("99999999999999999G"), None);
    }
}
