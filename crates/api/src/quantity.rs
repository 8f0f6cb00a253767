//! Parsing Kubernetes resource quantities (`1Gi`, `500m`, `1.5e3`) into numbers, for validation
//! and comparison. The canonical string form is left to the caller.

/// A quantity could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)]
pub struct QuantityError;

/// Parse a quantity into its value in base units (bytes for memory, cores for CPU).
pub fn parse(s: &str) -> Result<f64, QuantityError> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return Err(QuantityError);
    }
    let bytes = s.as_bytes();
    let mut end = 0;
    if matches!(bytes.first(), Some(b'+') | Some(b'-')) {
        end = 1;
    }
    let digits_start = end;
    while end < bytes.len() && (bytes[end].is_ascii_digit() || bytes[end] == b'.') {
        end += 1;
    }
    let number = &s[..end];
    let digits = &s[digits_start..end];
    if digits.is_empty() || digits == "." || digits.matches('.').count() > 1 {
        return Err(QuantityError);
    }
    let value: f64 = number.parse().map_err(|_| QuantityError)?;
    let suffix = &s[end..];
    let multiplier = match suffix {
        "" => 1.0,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        exp if exp.starts_with(['e', 'E']) => {
            let e: i32 = exp[1..].parse().map_err(|_| QuantityError)?;
            if !(-30..=30).contains(&e) {
                return Err(QuantityError);
            }
            10f64.powi(e)
        }
        _ => return Err(QuantityError),
    };
    Ok(value * multiplier)
}

/// 1 MiB, the smallest guest memory ferrovirt accepts.
pub const MIN_GUEST_MEMORY: f64 = 1024.0 * 1024.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse("1Gi"), Ok(1073741824.0));
        assert_eq!(parse("512Mi"), Ok(536870912.0));
        assert_eq!(parse("500m"), Ok(0.5));
        assert_eq!(parse("2"), Ok(2.0));
        assert_eq!(parse("1.5e3"), Ok(1500.0));
        assert_eq!(parse("1k"), Ok(1000.0));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Gi", "1GB", "abc", "1..2", ".", "1e", "--1", "1 Gi x"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
