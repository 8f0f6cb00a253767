//! Parsing Kubernetes resource quantities (`1Gi`, `500m`, `1.5e3`) into numbers, for validation
//! and comparison. The canonical string form is left to the caller. Resource accounting uses the
//! exact forms ([`exact`], [`millis`], [`bytes`]): decimal digits times powers of ten and 1024 in
//! integers, rounded up once at the end as Kubernetes does, so `9m` CPU is 9 millicores (a float
//! made it 10). `k8s-openapi`'s `Quantity` is only a string, so no crate does this for us.

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

/// A quantity as exact integers: `mantissa × 10^exp10 × 1024^bin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exact {
    pub mantissa: i128,
    pub exp10: i32,
    pub bin: u32,
}

/// Parses a quantity without rounding (at most 38 significant digits).
pub fn exact(s: &str) -> Result<Exact, QuantityError> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return Err(QuantityError);
    }
    let (negative, body) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let end = body
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(body.len());
    let (number, suffix) = body.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(QuantityError);
    }
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 38 {
        return Err(QuantityError);
    }
    let mut mantissa: i128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| QuantityError)?
    };
    if negative {
        mantissa = -mantissa;
    }
    let (exp, bin) = match suffix {
        "" => (0, 0),
        "Ki" => (0, 1),
        "Mi" => (0, 2),
        "Gi" => (0, 3),
        "Ti" => (0, 4),
        "Pi" => (0, 5),
        "Ei" => (0, 6),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        e if e.starts_with(['e', 'E']) => {
            let e: i32 = e[1..].parse().map_err(|_| QuantityError)?;
            if !(-30..=30).contains(&e) {
                return Err(QuantityError);
            }
            (e, 0)
        }
        _ => return Err(QuantityError),
    };
    Ok(Exact {
        mantissa,
        exp10: exp - frac.len() as i32,
        bin,
    })
}

impl Exact {
    /// The value times 10^`scale`, rounded up (towards +∞); `None` when it does not fit.
    pub fn scaled_ceil(self, scale: i32) -> Option<i128> {
        let mut v = self.mantissa;
        for _ in 0..self.bin {
            v = v.checked_mul(1024)?;
        }
        let e = self.exp10 + scale;
        if e >= 0 {
            return v.checked_mul(10i128.checked_pow(e as u32)?);
        }
        let Some(d) = 10i128.checked_pow(e.unsigned_abs()) else {
            // Smaller than any unit: the ceiling of a tiny positive value is 1.
            return Some(i128::from(v > 0));
        };
        Some(v.div_euclid(d) + i128::from(v.rem_euclid(d) != 0))
    }
}

/// Millicores (or thousandths of any unit) of a quantity, rounded up; negative values are refused.
pub fn millis(s: &str) -> Result<u64, QuantityError> {
    exact(s)?
        .scaled_ceil(3)
        .and_then(|v| u64::try_from(v).ok())
        .ok_or(QuantityError)
}

/// Base units (bytes) of a quantity, rounded up; negative values are refused.
pub fn bytes(s: &str) -> Result<u64, QuantityError> {
    exact(s)?
        .scaled_ceil(0)
        .and_then(|v| u64::try_from(v).ok())
        .ok_or(QuantityError)
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
    fn exact_forms_round_up_once() {
        assert_eq!(millis("9m"), Ok(9));
        assert_eq!(millis("0.009"), Ok(9));
        assert_eq!(millis("100m"), Ok(100));
        assert_eq!(millis("1.5"), Ok(1500));
        assert_eq!(millis("1u"), Ok(1));
        assert_eq!(millis("2"), Ok(2000));
        assert_eq!(millis("1e-30"), Ok(1));
        assert_eq!(millis("0"), Ok(0));
        assert_eq!(bytes("1Gi"), Ok(1 << 30));
        assert_eq!(bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(bytes("0.1Ki"), Ok(103));
        assert_eq!(bytes("1.5e3"), Ok(1500));
        assert_eq!(bytes("128974848"), Ok(128974848));
        assert_eq!(bytes("129e6"), Ok(129_000_000));
        assert_eq!(bytes("123Mi"), Ok(123 << 20));
        assert_eq!(bytes("16Ei"), Err(QuantityError));
        assert_eq!(bytes("-1"), Err(QuantityError));
        assert_eq!(bytes("1e30"), Err(QuantityError));
        assert_eq!(exact("-1.5m").unwrap().scaled_ceil(3), Some(-1));
        assert!(exact("1..2").is_err() && exact(".").is_err() && exact("1.2.3").is_err());
        assert_eq!(bytes(".5Ki"), Ok(512));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Gi", "1GB", "abc", "1..2", ".", "1e", "--1", "1 Gi x"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
