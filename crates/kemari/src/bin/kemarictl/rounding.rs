//! Numbers as a person reads them: the VMM reports times as exact floats
//! (`"paused_ms": 0.6295810000000001`); kemarictl prints each with six
//! significant digits, which keeps a microsecond of a millisecond figure
//! and drops the binary representation's noise. Integers are untouched.

use serde_json::{Number, Value};

/// Significant digits a printed float keeps.
const DIGITS: i32 = 6;

/// `v` with every non-integer number rounded to [`DIGITS`] significant digits.
pub fn rounded(v: Value) -> Value {
    match v {
        Value::Number(n) if n.is_f64() => n
            .as_f64()
            .map(round)
            .and_then(Number::from_f64)
            .map_or(Value::Number(n), Value::Number),
        Value::Array(items) => Value::Array(items.into_iter().map(rounded).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, rounded(v))).collect())
        }
        other => other,
    }
}

fn round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = DIGITS - 1 - x.abs().log10().floor() as i32;
    if scale <= 0 {
        // Six or more digits before the point: nothing after it to tidy.
        return x.round();
    }
    let p = 10f64.powi(scale);
    (x * p).round() / p
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_keep_six_significant_digits_and_integers_stay() {
        let v = rounded(json!({
            "paused_ms": 0.6295810000000001,
            "downtime_ms": 12.345678,
            "rate": 0.000123456789,
            "total_ms": 1234567.89,
            "state_bytes": 11655,
            "steps": [{"ms": 1.0000000000000002}],
            "name": "warm",
        }));
        assert_eq!(
            v,
            json!({
                "paused_ms": 0.629581,
                "downtime_ms": 12.3457,
                "rate": 0.000123457,
                "total_ms": 1234568.0,
                "state_bytes": 11655,
                "steps": [{"ms": 1.0}],
                "name": "warm",
            })
        );
        assert_eq!(
            serde_json::to_string(&rounded(json!(0.6295810000000001))).unwrap(),
            "0.629581"
        );
    }
}
